//! Shape arithmetic: contiguous strides and broadcasting (NumPy / PyTorch rules).

use crate::{Error, Result};

/// Row-major strides of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// `shape` with its last dimension set to `last` (a projection's output for its input, an
/// output gradient's expected shape); unchanged when `shape` is a scalar's.
pub fn with_last_dim(shape: &[usize], last: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(d) = out.last_mut() {
        *d = last;
    }
    out
}

/// The shape two operands broadcast to: dimensions align from the right, and each pair
/// must be equal or contain a 1.
pub fn broadcast_shapes(op: &'static str, lhs: &[usize], rhs: &[usize]) -> Result<Vec<usize>> {
    let rank = lhs.len().max(rhs.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let l = if i < rank - lhs.len() { 1 } else { lhs[i - (rank - lhs.len())] };
        let r = if i < rank - rhs.len() { 1 } else { rhs[i - (rank - rhs.len())] };
        out[i] = match (l, r) {
            (a, b) if a == b => a,
            (1, b) => b,
            (a, 1) => a,
            _ => return Err(Error::ShapeMismatch { op, lhs: lhs.to_vec(), rhs: rhs.to_vec() }),
        };
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_rules() {
        assert_eq!(broadcast_shapes("t", &[2, 1, 3], &[4, 1]).unwrap(), vec![2, 4, 3]);
        assert_eq!(broadcast_shapes("t", &[], &[5]).unwrap(), vec![5]);
        let err = broadcast_shapes("add", &[2, 3], &[4]).unwrap_err();
        assert_eq!(err.to_string(), "add: shapes [2, 3] and [4] do not match");
    }

    #[test]
    fn strides() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<usize>::new());
    }
}
