//! Strided gather into a contiguous buffer: the kernel behind `contiguous()`, broadcasting
//! materialisation and concatenation.
//!
//! PyTorch equivalent: `x.contiguous()` (an `aten::copy_` from a strided view).

/// Copies the strided view `src[offset + Σ i_d·strides[d]]` for every index `i` of `shape`
/// into `dst` in row-major order. A stride of 0 repeats (broadcasts) that dimension.
pub fn copy_strided(src: &[f32], offset: usize, shape: &[usize], strides: &[usize], dst: &mut [f32]) {
    let numel: usize = shape.iter().product();
    assert_eq!(dst.len(), numel, "copy_strided: dst has the wrong length");
    assert_eq!(shape.len(), strides.len(), "copy_strided: shape and strides differ in rank");
    if numel == 0 {
        return;
    }
    if shape.is_empty() {
        dst[0] = src[offset];
        return;
    }
    // The innermost dimension is copied as a run; the outer ones are walked with an odometer.
    let rank = shape.len();
    let inner = shape[rank - 1];
    let inner_stride = strides[rank - 1];
    let mut index = vec![0usize; rank - 1];
    let mut base = offset;
    for row in dst.chunks_exact_mut(inner) {
        if inner_stride == 1 {
            row.copy_from_slice(&src[base..base + inner]);
        } else {
            for (i, out) in row.iter_mut().enumerate() {
                *out = src[base + i * inner_stride];
            }
        }
        // Advance the odometer over the outer dimensions.
        for d in (0..rank - 1).rev() {
            index[d] += 1;
            base += strides[d];
            if index[d] < shape[d] {
                break;
            }
            base -= strides[d] * shape[d];
            index[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_copy() {
        // [[0,1,2],[3,4,5]] viewed transposed as 3x2.
        let src = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let mut dst = [0.0; 6];
        copy_strided(&src, 0, &[3, 2], &[1, 3], &mut dst);
        assert_eq!(dst, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    }

    #[test]
    fn broadcast_copy() {
        let src = [1.0, 2.0];
        let mut dst = [0.0; 6];
        copy_strided(&src, 0, &[3, 2], &[0, 1], &mut dst);
        assert_eq!(dst, [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
    }
}
