//! Launchers of `elementwise.cu`: unary ops and their backward, broadcasting binary ops,
//! axpy / add_assign, select, strided copy, scaled copies, and f32 ↔ bf16 conversion.
//!
//! Signatures mirror `cpu::unary`, `cpu::binary` and `cpu::copy` with slices replaced by
//! device buffers; the unary backward writes its gradient (`dx = ...`). Broadcast shapes are
//! coalesced on the host exactly as the CPU does (size-1 dims dropped, contiguous neighbours
//! merged); the GPU kernels take at most [`MAX_RANK`] dimensions after that.

use half::bf16;

pub use crate::cpu::binary::Binary;
pub use crate::cpu::unary::Unary;

use super::allocator::DeviceBuffer;
use super::device::CudaDevice;
use super::error::{ensure, ensure_len, Result};
use super::launch::{address_list, check_owners, elementwise, int, length_list, opt_ptr, ptr, ptr_at, size, LIST_LEN};
use super::module::{Arg, KernelFamily};

/// Most dimensions a broadcast or strided copy may keep after coalescing.
pub const MAX_RANK: usize = 8;

const FAMILY: KernelFamily = KernelFamily::Elementwise;

/// The kernel's op code and `Powf` exponent for `op`.
pub(crate) fn unary_code(op: Unary) -> (i32, f32) {
    match op {
        Unary::Neg => (0, 0.0),
        Unary::Exp => (1, 0.0),
        Unary::Log => (2, 0.0),
        Unary::Sqrt => (3, 0.0),
        Unary::Rsqrt => (4, 0.0),
        Unary::Abs => (5, 0.0),
        Unary::Sigmoid => (6, 0.0),
        Unary::Tanh => (7, 0.0),
        Unary::Relu => (8, 0.0),
        Unary::Silu => (9, 0.0),
        Unary::Gelu => (10, 0.0),
        Unary::GeluTanh => (11, 0.0),
        Unary::Powf(p) => (12, p),
        Unary::Square => (13, 0.0),
    }
}

fn binary_code(op: Binary) -> i32 {
    match op {
        Binary::Add => 0,
        Binary::Sub => 1,
        Binary::Mul => 2,
        Binary::Div => 3,
        Binary::Maximum => 4,
        Binary::Minimum => 5,
    }
}

/// `y[i] = f(x[i])`.
pub fn unary_forward(dev: &CudaDevice, op: Unary, x: &DeviceBuffer<f32>, y: &mut DeviceBuffer<f32>) -> Result<()> {
    const OP: &str = "unary_forward";
    check_owners(dev, OP, &[x, y])?;
    ensure_len(OP, "y", y.len(), x.len())?;
    let (code, p) = unary_code(op);
    let args = [int(code), Arg::F32(p), ptr(x), ptr(y), size(x.len())];
    dev.launch(FAMILY, "unary_forward", elementwise(x.len()), &args)
}

/// `dx = dy · f'(x)`; `y = f(x)` is the saved forward output.
pub fn unary_backward(
    dev: &CudaDevice,
    op: Unary,
    x: &DeviceBuffer<f32>,
    y: &DeviceBuffer<f32>,
    dy: &DeviceBuffer<f32>,
    dx: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "unary_backward";
    check_owners(dev, OP, &[x, y, dy, dx])?;
    let n = dx.len();
    ensure(x.len() == n && y.len() == n && dy.len() == n, OP, || {
        format!("x ({}), y ({}), dy ({}) and dx ({n}) differ in length", x.len(), y.len(), dy.len())
    })?;
    let (code, p) = unary_code(op);
    let args = [int(code), Arg::F32(p), ptr(x), ptr(y), ptr(dy), ptr(dx), size(n)];
    dev.launch(FAMILY, "unary_backward", elementwise(n), &args)
}

/// One output dimension with the stride each operand walks it with.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Dim {
    size: usize,
    a: usize,
    b: usize,
}

/// Drops size-1 dimensions and merges a dimension into its inner neighbour when both
/// operands step over it contiguously (the CPU's `coalesce`).
fn coalesce(shape: &[usize], a_strides: &[usize], b_strides: &[usize]) -> Vec<Dim> {
    let mut dims: Vec<Dim> = Vec::with_capacity(shape.len());
    for ((&size, &a), &b) in shape.iter().zip(a_strides).zip(b_strides) {
        if size == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(prev) if prev.a == a * size && prev.b == b * size => *prev = Dim { size: prev.size * size, a, b },
            _ => dims.push(Dim { size, a, b }),
        }
    }
    dims
}

/// Largest index a strided view reaches (every size ≥ 1).
fn reach(offset: usize, shape: &[usize], strides: &[usize]) -> usize {
    offset + shape.iter().zip(strides).map(|(&n, &s)| (n - 1) * s).sum::<usize>()
}

/// Packs up to [`MAX_RANK`] dims as the kernel's `Dims24`: sizes, a-strides, b-strides.
fn pack(dims: &[Dim]) -> Arg {
    let mut v = [0i64; 3 * MAX_RANK];
    for (d, dim) in dims.iter().enumerate() {
        v[d] = dim.size as i64;
        v[MAX_RANK + d] = dim.a as i64;
        v[2 * MAX_RANK + d] = dim.b as i64;
    }
    Arg::Dims(v)
}

/// `out[idx] = a[a_offset + Σ idx_d·a_strides[d]] op b[...]` over `out_shape` (contiguous
/// output); a stride of 0 broadcasts that dimension. Mirrors `cpu::binary::binary_forward`.
#[allow(clippy::too_many_arguments)]
pub fn binary_forward(
    dev: &CudaDevice,
    op: Binary,
    a: &DeviceBuffer<f32>,
    a_offset: usize,
    a_strides: &[usize],
    b: &DeviceBuffer<f32>,
    b_offset: usize,
    b_strides: &[usize],
    out_shape: &[usize],
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "binary_forward";
    check_owners(dev, OP, &[a, b, out])?;
    let numel: usize = out_shape.iter().product();
    ensure_len(OP, "out", out.len(), numel)?;
    ensure(a_strides.len() == out_shape.len() && b_strides.len() == out_shape.len(), OP, || {
        "strides and shape differ in rank".to_string()
    })?;
    if numel == 0 {
        return Ok(());
    }
    ensure(reach(a_offset, out_shape, a_strides) < a.len(), OP, || "a is too short for its view".to_string())?;
    ensure(reach(b_offset, out_shape, b_strides) < b.len(), OP, || "b is too short for its view".to_string())?;
    let dims = coalesce(out_shape, a_strides, b_strides);
    ensure(dims.len() <= MAX_RANK, OP, || format!("{} dimensions after coalescing (at most {MAX_RANK})", dims.len()))?;
    let args = [
        int(binary_code(op)),
        ptr_at(a, a_offset),
        ptr_at(b, b_offset),
        pack(&dims),
        int(dims.len() as i32),
        ptr(out),
        size(numel),
    ];
    dev.launch(FAMILY, "binary_forward", elementwise(numel), &args)
}

/// `out[i] = x[i] op s`.
pub fn scalar_forward(
    dev: &CudaDevice,
    op: Binary,
    x: &DeviceBuffer<f32>,
    s: f32,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "scalar_forward";
    check_owners(dev, OP, &[x, out])?;
    ensure_len(OP, "out", out.len(), x.len())?;
    let args = [int(binary_code(op)), ptr(x), Arg::F32(s), ptr(out), size(x.len())];
    dev.launch(FAMILY, "scalar_forward", elementwise(x.len()), &args)
}

/// `y[i] = value` for every element (one launch, no host upload; zeros are a memset:
/// `CudaDevice::fill_zero`).
pub fn fill(dev: &CudaDevice, value: f32, y: &mut DeviceBuffer<f32>) -> Result<()> {
    check_owners(dev, "fill", &[y])?;
    let args = [Arg::F32(value), ptr(y), size(y.len())];
    dev.launch(FAMILY, "fill", elementwise(y.len()), &args)
}

/// `dst[i] += src[i]`: the autograd engine's sum of two gradients of one value; `dst_bf16`,
/// when given, gets the sum rounded to nearest even (for the bf16 products that read it).
pub fn add_assign(
    dev: &CudaDevice,
    dst: &mut DeviceBuffer<f32>,
    src: &DeviceBuffer<f32>,
    dst_bf16: Option<&mut DeviceBuffer<bf16>>,
) -> Result<()> {
    if let Some(twin) = &dst_bf16 {
        dev.check_owner("add_assign", twin)?;
        ensure_len("add_assign", "dst_bf16", twin.len(), dst.len())?;
    }
    queue_axpy(dev, 1.0, src, dst, dst_bf16.as_deref())
}

/// `dst[i] += alpha·src[i]`.
pub fn axpy(dev: &CudaDevice, alpha: f32, src: &DeviceBuffer<f32>, dst: &mut DeviceBuffer<f32>) -> Result<()> {
    queue_axpy(dev, alpha, src, dst, None)
}

/// The `axpy` kernel, writing `dst_bf16` too when given (its owner and length checked).
fn queue_axpy(
    dev: &CudaDevice,
    alpha: f32,
    src: &DeviceBuffer<f32>,
    dst: &mut DeviceBuffer<f32>,
    dst_bf16: Option<&DeviceBuffer<bf16>>,
) -> Result<()> {
    const OP: &str = "axpy";
    check_owners(dev, OP, &[src, dst])?;
    ensure_len(OP, "dst", dst.len(), src.len())?;
    let args = [Arg::F32(alpha), ptr(src), ptr(dst), opt_ptr(dst_bf16), size(src.len())];
    dev.launch(FAMILY, "axpy", elementwise(src.len()), &args)
}

/// `out[i] = if cond[i] != 0 { a[i] } else { b[i] }`.
pub fn select(
    dev: &CudaDevice,
    cond: &DeviceBuffer<f32>,
    a: &DeviceBuffer<f32>,
    b: &DeviceBuffer<f32>,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "select";
    check_owners(dev, OP, &[cond, a, b, out])?;
    let n = out.len();
    ensure(cond.len() == n && a.len() == n && b.len() == n, OP, || "cond, a, b and out differ in length".to_string())?;
    let args = [ptr(cond), ptr(a), ptr(b), ptr(out), size(n)];
    dev.launch(FAMILY, "select_where", elementwise(n), &args)
}

/// Copies the strided view `src[offset + Σ i_d·strides[d]]` into `dst` in row-major order
/// (stride 0 repeats a dimension). Mirrors `cpu::copy::copy_strided`.
pub fn copy_strided(
    dev: &CudaDevice,
    src: &DeviceBuffer<f32>,
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    dst: &mut DeviceBuffer<f32>,
) -> Result<()> {
    const OP: &str = "copy_strided";
    check_owners(dev, OP, &[src, dst])?;
    let numel: usize = shape.iter().product();
    ensure_len(OP, "dst", dst.len(), numel)?;
    ensure(shape.len() == strides.len(), OP, || "shape and strides differ in rank".to_string())?;
    if numel == 0 {
        return Ok(());
    }
    ensure(reach(offset, shape, strides) < src.len(), OP, || "src is too short for its view".to_string())?;
    // The destination is contiguous: merge with the same rule, giving it the b strides.
    let contiguous: Vec<usize> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
    let dims = coalesce(shape, strides, &contiguous);
    ensure(dims.len() <= MAX_RANK, OP, || format!("{} dimensions after coalescing (at most {MAX_RANK})", dims.len()))?;
    let args = [ptr_at(src, offset), pack(&dims), int(dims.len() as i32), ptr(dst), size(numel)];
    dev.launch(FAMILY, "copy_strided", elementwise(numel), &args)
}

/// `dst[i] = bf16(src[i])`, rounding to nearest even (as `half::bf16::from_f32`).
pub fn to_bf16(dev: &CudaDevice, src: &DeviceBuffer<f32>, dst: &mut DeviceBuffer<bf16>) -> Result<()> {
    const OP: &str = "to_bf16";
    dev.check_owner(OP, src)?;
    dev.check_owner(OP, dst)?;
    ensure_len(OP, "dst", dst.len(), src.len())?;
    let args = [ptr(src), ptr(dst), size(src.len())];
    dev.launch(FAMILY, "f32_to_bf16_kernel", elementwise(src.len()), &args)
}

/// The f32 buffers `parts` rounded to bf16 (to nearest even), back to back in one new buffer,
/// in one launch: several weights one GEMM reads as one operand (a fused gated projection's
/// `[W; A_c; A_s]`, the FFN's `[W_gate; W_up]`); at most [`LIST_LEN`] parts.
pub fn pack_bf16(dev: &CudaDevice, parts: &[&DeviceBuffer<f32>]) -> Result<DeviceBuffer<bf16>> {
    const OP: &str = "pack_bf16";
    check_owners(dev, OP, parts)?;
    ensure(parts.len() <= LIST_LEN, OP, || format!("{} parts, at most {LIST_LEN}", parts.len()))?;
    // Where each part starts in the packed buffer.
    let starts: Vec<usize> = parts.iter().scan(0, |at, part| Some(std::mem::replace(at, *at + part.len()))).collect();
    let total = parts.iter().map(|part| part.len()).sum();
    let packed = dev.alloc::<bf16>(total)?;
    let mut cfg = elementwise(parts.iter().map(|part| part.len()).max().unwrap_or(0));
    cfg.grid_dim.1 = parts.len() as u32;
    let args = [
        address_list(parts.iter().map(|part| part.device_ptr())),
        length_list(parts.iter().map(|part| part.len())),
        length_list(starts.into_iter()),
        ptr(&packed),
    ];
    dev.launch(FAMILY, "f32_to_bf16_packed", cfg, &args)?;
    Ok(packed)
}

/// `dst = s[0]·src` for each `(src, dst)` pair of equal lengths (at most [`LIST_LEN`]), in one
/// launch: `s` is one element on the device, the upstream gradient of a loss, which the host
/// does not wait for (the LM head's saved gradients times it: `Tensor::linear_cross_entropy`).
pub fn scaled_copies(
    dev: &CudaDevice,
    s: &DeviceBuffer<f32>,
    parts: &mut [(&DeviceBuffer<f32>, &mut DeviceBuffer<f32>)],
) -> Result<()> {
    const OP: &str = "scaled_copies";
    ensure_len(OP, "s", s.len(), 1)?;
    dev.check_owner(OP, s)?;
    ensure(parts.len() <= LIST_LEN, OP, || format!("{} parts, at most {LIST_LEN}", parts.len()))?;
    for (src, dst) in parts.iter() {
        check_owners(dev, OP, &[src, dst])?;
        ensure_len(OP, "dst", dst.len(), src.len())?;
    }
    let longest = parts.iter().map(|(src, _)| src.len()).max().unwrap_or(0);
    if longest == 0 {
        return Ok(());
    }
    let mut cfg = elementwise(longest);
    cfg.grid_dim.1 = parts.len() as u32;
    let args = [
        ptr(s),
        address_list(parts.iter().map(|(src, _)| src.device_ptr())),
        address_list(parts.iter().map(|(_, dst)| dst.device_ptr())),
        length_list(parts.iter().map(|(src, _)| src.len())),
    ];
    dev.launch(FAMILY, "scaled_copies", cfg, &args)
}

/// `dst[i] = f32(src[i])` (exact).
pub fn to_f32(dev: &CudaDevice, src: &DeviceBuffer<bf16>, dst: &mut DeviceBuffer<f32>) -> Result<()> {
    const OP: &str = "to_f32";
    dev.check_owner(OP, src)?;
    dev.check_owner(OP, dst)?;
    ensure_len(OP, "dst", dst.len(), src.len())?;
    let args = [ptr(src), ptr(dst), size(src.len())];
    dev.launch(FAMILY, "bf16_to_f32_kernel", elementwise(src.len()), &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_merges_contiguous_and_drops_unit_dims() {
        // [2, 3, 4] contiguous in both: one run of 24.
        assert_eq!(coalesce(&[2, 3, 4], &[12, 4, 1], &[12, 4, 1]), vec![Dim { size: 24, a: 1, b: 1 }]);
        // A bias [4] over [2, 3, 4]: rows of 4 against a broadcast outer run of 6.
        let dims = coalesce(&[2, 1, 3, 4], &[12, 12, 4, 1], &[0, 0, 0, 1]);
        assert_eq!(dims, vec![Dim { size: 6, a: 4, b: 0 }, Dim { size: 4, a: 1, b: 1 }]);
    }
}
