//! tesserad
