//! autograd
