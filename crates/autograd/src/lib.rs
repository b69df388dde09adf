//! # kiln-autograd
//!
//! Define-by-run automatic differentiation (`Var<B>`, `backward`, `check_backward`). Not built
//! yet; see the autograd issue.
