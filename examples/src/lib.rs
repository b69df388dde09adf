//! Shared support for the examples (device selection from a string).
