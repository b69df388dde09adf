//! The conformance suite (to be written).
