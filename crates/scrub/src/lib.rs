//! scrub
