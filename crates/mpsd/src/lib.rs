//! mpsd
