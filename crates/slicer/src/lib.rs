//! slicer
