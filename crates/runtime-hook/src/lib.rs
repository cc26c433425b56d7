//! runtime-hook
