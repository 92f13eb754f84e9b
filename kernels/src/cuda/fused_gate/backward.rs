//! The backward of a group of fused gated projections on the GPU (Transponder eq. 8-10):
//! the gradient buffers it writes, the precision of its products, and the operands they read.

use half::bf16;

use super::super::allocator::DeviceBuffer;
use super::super::blas::{gemm, GemmDims, Operand, Precision};
use super::super::device::CudaDevice;
use super::super::elementwise::unary_code;
use super::super::error::{ensure, ensure_len, Result};
use super::super::launch::{check_owners, int, ptr, size};
use super::super::module::Arg;
use super::super::norm::RmsNormWeightPartials;
use super::super::reduce::{column_sums_many, ColumnSum};
use super::super::values::{kernel_for_gradient, DeviceValues, Values, ValuesMut};
use super::{epilogue_group, group_lists, layout, BackwardSplit, GateGroup, Layout, FAMILY};
use crate::cpu::matmul::Store;

/// Gradient buffers of one modulator, written by the backward (`dA` and `dB` are parts of
/// [`DeviceFusedGateGrads`]'s packed buffers).
#[derive(Debug)]
pub struct DeviceGateGrads<'a> {
    /// `da: [r]`.
    pub a_bias: &'a mut DeviceBuffer<f32>,
    /// `db: [m]`.
    pub b_bias: &'a mut DeviceBuffer<f32>,
    /// `dα`: a one-element buffer.
    pub alpha: &'a mut DeviceBuffer<f32>,
}

impl DeviceGateGrads<'_> {
    /// The three buffers, in field order.
    fn buffers(&mut self) -> [&mut DeviceBuffer<f32>; 3] {
        [&mut *self.a_bias, &mut *self.b_bias, &mut *self.alpha]
    }
}

/// Gradient buffers of the fused projection, written by the backward.
#[derive(Debug)]
pub struct DeviceFusedGateGrads<'a> {
    /// `dx: [N, d_in]`: f32, or under bf16 products bf16 alone (rounded from the product's f32
    /// sums, for an input whose only gradient this is and whose readers take bf16).
    pub x: ValuesMut<'a>,
    /// Whether `dx` is written into `x` ([`Store::Overwrite`]) or added onto what `x` holds
    /// ([`Store::Accumulate`]: the GEMM's β = 1, so an input read by several projections gets
    /// its gradients summed without a separate add; f32 only).
    pub x_store: Store,
    /// The gradient of the packed weight, `[K, d_in]` in [`pack_weight`]'s layout (each
    /// projection's `[dW; dA_c; dA_s]` in turn): one product writes it, and each weight's
    /// gradient is its run of rows.
    pub weights: &'a mut DeviceBuffer<f32>,
    /// Every projection's channel `dB_c` in turn, `[Σ d_out, r_c]` (one product writes them
    /// when the projections are of one width).
    pub b_channel: &'a mut DeviceBuffer<f32>,
    /// Every projection's scalar `dB_s` in turn, `[projections, r_s]`.
    pub b_scalar: &'a mut DeviceBuffer<f32>,
    /// Each projection's channel modulator's gradients, in group order.
    pub channel: Vec<DeviceGateGrads<'a>>,
    /// Each projection's scalar modulator's gradients, in group order.
    pub scalar: Vec<DeviceGateGrads<'a>>,
}

/// Checks the gradient buffers against the group's sizes.
fn check_grads(
    dev: &CudaDevice,
    op: &'static str,
    groups: &[GateGroup],
    layout: &Layout,
    g: &DeviceFusedGateGrads,
) -> Result<()> {
    ensure(g.channel.len() == groups.len() && g.scalar.len() == groups.len(), op, || {
        format!("{} and {} modulator gradients for {} projections", g.channel.len(), g.scalar.len(), groups.len())
    })?;
    let (rc, rs) = (layout.rank_channel, layout.rank_scalar);
    let dx = g.x.as_values();
    dx.check_owner(dev, op)?;
    ensure_len(op, "dx", dx.len(), layout.rows * layout.d_in)?;
    ensure(!dx.is_bf16() || g.x_store == Store::Overwrite, op, || "a bf16 dx is written, not added to".to_string())?;
    let mut expected = vec![
        (&*g.weights, layout.zu_width * layout.d_in, "packed weight gradient"),
        (&*g.b_channel, layout.out_width * rc, "packed channel dB"),
        (&*g.b_scalar, groups.len() * rs, "packed scalar dB"),
    ];
    for ((group, c), s) in groups.iter().zip(&g.channel).zip(&g.scalar) {
        let d_out = group.dims.d_out;
        expected.extend([
            (&*c.a_bias, rc, "channel da"),
            (&*c.b_bias, d_out, "channel db"),
            (&*c.alpha, 1, "channel dα"),
            (&*s.a_bias, rs, "scalar da"),
            (&*s.b_bias, 1, "scalar db"),
            (&*s.alpha, 1, "scalar dα"),
        ]);
    }
    for (buffer, want, name) in expected {
        dev.check_owner(op, buffer)?;
        ensure_len(op, name, buffer.len(), want)?;
    }
    Ok(())
}

/// The precision of [`fused_gate_backward`]'s products, and the input `x` they read in it.
#[derive(Clone, Copy, Debug)]
pub enum GateProducts<'a> {
    /// f32 operands and products (cuBLAS's default math mode: the CUDA cores, no TF32).
    F32 {
        /// `x`, `[N, d_in]`.
        x: &'a DeviceBuffer<f32>,
    },
    /// bf16 operands on the tensor cores, f32 accumulation and outputs (mixed precision, as
    /// every other product under `--bf16`). `x` and the packed weight are the forward's bf16
    /// operands; the backward's row kernel writes `dZU` in bf16 alone (no conversion launch,
    /// no f32 `[N, K]` buffer: the bias gradients of `U` sum an f32 copy of its few columns).
    Bf16 {
        /// `x` in bf16, `[N, d_in]`.
        x: &'a DeviceBuffer<bf16>,
        /// `[W; A_c; A_s]` in bf16, `[K, d_in]` ([`pack_weight`]'s layout).
        packed: &'a DeviceBuffer<bf16>,
    },
}

/// The gradient [`fused_gate_backward`] starts from.
#[derive(Clone, Copy, Debug)]
pub enum OutputGrad<'a> {
    /// The output gradient `dẐ`, `[N, Σ d_out]`: f32, or bf16 beside a bf16 `zu` when the
    /// consumer of the output wrote its gradient so (attention's and RoPE's backward under bf16
    /// products).
    Direct(Values<'a>),
    /// The FFN's gate and up group (two projections of one width F) whose output SwiGLU read
    /// ([`super::fused_gate_forward_swiglu`]), under bf16 products: SwiGLU's output gradient
    /// `dout` (`[N, F]`) and the group's gated output `gated` (`[N, 2F]`, as that forward wrote
    /// it). The row kernel computes `dẐ` from them with swiglu.cu's arithmetic, rounded to bf16
    /// as SwiGLU's backward stores it: the same bits as that backward's launch, then this one
    /// from its result, without the launch or its `[N, 2F]` gradient.
    Swiglu {
        /// SwiGLU's output gradient, `[N, F]`.
        dout: &'a DeviceBuffer<bf16>,
        /// The gate then up projection's gated outputs, `[N, 2F]`.
        gated: &'a DeviceBuffer<bf16>,
    },
}

impl OutputGrad<'_> {
    /// Checks the buffers against the group (`[N, out_width]` of output) and `zu`; SwiGLU's
    /// against the group its forward epilogue serves ([`epilogue_group`]).
    fn check(
        &self,
        dev: &CudaDevice,
        op: &'static str,
        groups: &[GateGroup],
        layout: &Layout,
        zu: &DeviceValues,
    ) -> Result<()> {
        let rows = layout.rows;
        match *self {
            OutputGrad::Direct(dout) => {
                dout.check_owner(dev, op)?;
                ensure_len(op, "dout", dout.len(), rows * layout.out_width)
            }
            OutputGrad::Swiglu { dout, gated } => {
                let d_out = epilogue_group(op, groups, &["gate", "up"], zu)?;
                dev.check_owner(op, dout)?;
                dev.check_owner(op, gated)?;
                ensure_len(op, "SwiGLU's dout", dout.len(), rows * d_out)?;
                ensure_len(op, "gated output", gated.len(), rows * layout.out_width)
            }
        }
    }
}

/// Backward of a group of fused projections from the saved `zu` (`[N, K]`) and the output
/// gradient `dout` ([`OutputGrad`]); `products` holds the input `x`, read only by the weight
/// gradient's product (so under bf16 products no f32 `x` is kept). Writes every buffer of
/// `grads`; `dx` is the sum over the group's projections.
///
/// One row kernel recomputes `H`, `γ_s` and the channel logits from `zu` and writes `dZ` and
/// `dU` (through `dH_c = dL_c·B_c`, summed over each row's columns in the kernel), and, for
/// every projection, each of its blocks' terms of the cross-row sums: `dB_c = dL_cᵀ·H_c` and
/// `db_c` (each thread sums its column over the block's rows, so the channel logits'
/// gradient `dL_c` is never stored), `da`, `dα_c`, `dα_s`, `db_s` and `dB_s = dl_sᵀ·H_s`. One
/// column-sum launch adds the blocks' terms up in a fixed order (a few hundred rows where the
/// sums over `N` rows used to be), and `dx = dZU·packed` and the packed weight's gradient
/// `dZUᵀ·x` are one product each (in the precision of `products`).
#[allow(clippy::too_many_arguments)]
pub fn fused_gate_backward(
    dev: &CudaDevice,
    groups: &[GateGroup],
    zu: &DeviceValues,
    dout: OutputGrad,
    products: GateProducts,
    grads: &mut DeviceFusedGateGrads,
) -> Result<()> {
    fused_gate_backward_with_norm(dev, groups, zu, dout, products, grads, None)
}

/// [`fused_gate_backward`] of a gated output projection whose output a residual add and
/// RMSNorm read (`fused_gate_forward_add_rms_norm`), with that norm's weight gradient `dw`
/// finished from its backward's partial sums (`norm::rms_norm_backward_partial`) in the
/// gate's column-sum launch: the same bits as the norm's own finish, one launch fewer.
#[allow(clippy::too_many_arguments)]
pub fn fused_gate_backward_with_norm(
    dev: &CudaDevice,
    groups: &[GateGroup],
    zu: &DeviceValues,
    dout: OutputGrad,
    products: GateProducts,
    grads: &mut DeviceFusedGateGrads,
    norm: Option<(&RmsNormWeightPartials, &mut DeviceBuffer<f32>)>,
) -> Result<()> {
    const OP: &str = "fused_gate_backward";
    if let Some((partials, dw)) = &norm {
        check_owners(dev, OP, &[partials.buffer(), &**dw])?;
        ensure_len(OP, "the norm's dw", dw.len(), partials.cols())?;
    }
    let layout = layout(dev, OP, groups)?;
    check_grads(dev, OP, groups, &layout, grads)?;
    zu.values().check_owner(dev, OP)?;
    dout.check(dev, OP, groups, &layout, zu)?;
    let Layout { rows, d_in, rank_channel: rc, rank_scalar: rs, zu_width: k, out_width, .. } = layout;
    let (count, r) = (groups.len(), rc + rs);
    ensure_len(OP, "zu", zu.len(), rows * k)?;
    match products {
        GateProducts::F32 { x } => {
            dev.check_owner(OP, x)?;
            ensure_len(OP, "x", x.len(), rows * d_in)?;
            ensure(!grads.x.as_values().is_bf16(), OP, || "a bf16 dx needs bf16 products".to_string())?;
        }
        GateProducts::Bf16 { x, packed } => {
            dev.check_owner(OP, x)?;
            dev.check_owner(OP, packed)?;
            ensure_len(OP, "x (bf16)", x.len(), rows * d_in)?;
            ensure_len(OP, "packed weight", packed.len(), k * d_in)?;
        }
    }
    let g = grads;
    if rows == 0 {
        // No rows: every gradient is an empty sum.
        let modulators = g.channel.iter_mut().chain(g.scalar.iter_mut()).flat_map(DeviceGateGrads::buffers);
        for buffer in [&mut *g.weights, &mut *g.b_channel, &mut *g.b_scalar].into_iter().chain(modulators) {
            dev.fill_zero(buffer)?;
        }
        if let Some((_, dw)) = norm {
            dev.fill_zero(dw)?;
        }
        return g.x.fill_zero(dev);
    }
    // The row kernel's block terms of the cross-row sums, one row per block (see
    // gate_backward_rows in fused_gate.cu): dB_c's (`[blocks, out_width·rc]`, dB_c's packed
    // layout), db_c's (`[blocks, out_width]`), dU's (`[blocks, groups·r]`, for da) and each
    // projection's [dα_c, dα_s, dl_s, dl_s·H_s] (`[blocks, groups·(3 + rs)]`); row_sums is
    // its scratch (`[N, groups, rc + 2]`).
    let terms = 3 + rs;
    let split = BackwardSplit::new(rows);
    let blocks = split.blocks;
    let row_sums = dev.alloc::<f32>(rows * count * (rc + 2))?;
    let weight_terms = dev.alloc::<f32>(blocks * out_width * rc)?;
    let bias_terms = dev.alloc::<f32>(blocks * out_width)?;
    let du_terms = dev.alloc::<f32>(blocks * count * r)?;
    let row_terms = dev.alloc::<f32>(blocks * count * terms)?;

    let operands = match products {
        GateProducts::F32 { x } => Operands::F32 { x, dzu: dev.alloc::<f32>(rows * k)? },
        GateProducts::Bf16 { x, packed } => Operands::Bf16 { x, packed, dzu: dev.alloc::<bf16>(rows * k)? },
    };

    let (phi, phi_p) = unary_code(groups[0].params.phi);
    let [params, places] = group_lists(groups, &layout);
    let (kernel, gradient_args) = match dout {
        OutputGrad::Direct(dout) => {
            let kernels = [
                "fused_gate_backward_rows",
                "fused_gate_backward_rows_bf16",
                "fused_gate_backward_rows_bf16_dout_bf16",
            ];
            (kernel_for_gradient(OP, zu.values(), dout, kernels)?, vec![dout.arg_at(0)])
        }
        OutputGrad::Swiglu { dout, gated } => ("fused_gate_backward_rows_swiglu", vec![ptr(dout), ptr(gated)]),
    };
    let mut args = vec![zu.values().arg_at(0)];
    args.extend(gradient_args);
    args.extend([
        params,
        places,
        int(phi),
        Arg::F32(phi_p),
        size(rows),
        size(split.rows_per_block),
        size(k),
        size(out_width),
        int(rc as i32),
        int(rs as i32),
        Arg::Ptr(operands.dzu_f32()),
        Arg::Ptr(operands.dzu_bf16()),
        ptr(&row_sums),
        ptr(&weight_terms),
        ptr(&bias_terms),
        ptr(&du_terms),
        ptr(&row_terms),
    ]);
    dev.launch(FAMILY, kernel, split.launch(count), &args)?;

    // The cross-row sums over the blocks' terms: db_c, dB_c, da, dα, db_s and dB_s of every
    // projection in one launch (dB_c of every projection as one sum: its terms have the
    // packed gradient's layout).
    let sum = |src, cols, ld, dst: u64| ColumnSum { src, cols, ld, dst, own_rows: None };
    let mut sums = Vec::with_capacity(7 * count + 1);
    if rc > 0 {
        sums.push(sum(weight_terms.device_ptr(), out_width * rc, out_width * rc, g.b_channel.device_ptr()));
    }
    for (i, ((group, c), s)) in groups.iter().zip(&g.channel).zip(&g.scalar).enumerate() {
        let (d_out, out_at) = (group.dims.d_out, layout.out_at[i]);
        let t = i * terms;
        let row_term = |j: usize| row_terms.ptr_at(t + j);
        let terms_ld = count * terms;
        sums.extend([
            sum(bias_terms.ptr_at(out_at), d_out, out_width, c.b_bias.device_ptr()),
            sum(du_terms.ptr_at(i * r), rc, count * r, c.a_bias.device_ptr()),
            sum(du_terms.ptr_at(i * r + rc), rs, count * r, s.a_bias.device_ptr()),
            sum(row_term(0), 1, terms_ld, c.alpha.device_ptr()),
            sum(row_term(1), 1, terms_ld, s.alpha.device_ptr()),
            sum(row_term(2), 1, terms_ld, s.b_bias.device_ptr()),
            sum(row_term(3), rs, terms_ld, g.b_scalar.ptr_at(i * rs)),
        ]);
    }
    if let Some((partials, dw)) = &norm {
        sums.push(partials.finish_sum(dw.device_ptr()));
    }
    column_sums_many(dev, blocks, &sums)?;

    let precision = operands.precision();
    let gemm = |precision, m, n, k, a, b, store, c: u64, ldc| {
        gemm(dev, precision, GemmDims { m, n, k }, a, b, store, (c, ldc))
    };
    // dx = dZU·packed
    let dx = g.x.as_values();
    if let Operands::Bf16 { packed, .. } = &operands {
        // The packed bf16 weight makes dx one product over K, rounded to bf16 as it is stored
        // when dx is bf16.
        let weight = Operand::rows(packed.device_ptr(), d_in);
        let dx_precision = if dx.is_bf16() { Precision::Bf16Out } else { precision };
        let dzu = operands.rows(Part::Dzu, 0, k);
        gemm(dx_precision, rows, d_in, k, dzu, weight, g.x_store, dx.address(), d_in)?;
    } else {
        // Separate f32 weight buffers: the first product written, the others added onto it.
        let mut store = g.x_store;
        for (i, group) in groups.iter().enumerate() {
            let (d_out, p) = (group.dims.d_out, &group.params);
            let at = layout.zu_at[i];
            let parts =
                [(at, d_out, p.weight), (at + d_out, rc, p.channel.a_weight), (at + d_out + rc, rs, p.scalar.a_weight)];
            for (offset, width, weight) in parts {
                let (a, b) = (operands.rows(Part::Dzu, offset, k), Operand::rows(weight.device_ptr(), d_in));
                gemm(precision, rows, d_in, width, a, b, store, dx.address(), d_in)?;
                store = Store::Accumulate;
            }
        }
    }
    // The packed weight's gradient dZUᵀ·x: one product for every weight of the group.
    let x_rows = operands.rows(Part::X, 0, d_in);
    let dzu_t = operands.transposed(Part::Dzu, 0, k);
    gemm(precision, k, d_in, rows, dzu_t, x_rows, Store::Overwrite, g.weights.device_ptr(), d_in)?;
    Ok(())
}

/// An operand of the backward's products (the packed weight is reached through
/// [`Operands::Bf16`] directly: the f32 weights are separate buffers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Dzu,
    X,
}

/// Where the backward's products read their operands: the f32 input and the f32 `dZU` that
/// the row kernel writes, or the forward's bf16 `x` and packed weight and the bf16 `dZU`
/// that the row kernel writes in its place.
enum Operands<'a> {
    F32 {
        x: &'a DeviceBuffer<f32>,
        /// `dZU`, `[N, K]`.
        dzu: DeviceBuffer<f32>,
    },
    Bf16 {
        x: &'a DeviceBuffer<bf16>,
        /// `[W; A_c; A_s]`, `[K, d_in]`.
        packed: &'a DeviceBuffer<bf16>,
        /// `dZU` in bf16, `[N, K]`.
        dzu: DeviceBuffer<bf16>,
    },
}

impl Operands<'_> {
    /// Where the row kernel writes `dZU` in f32 (0, none, for bf16 products).
    fn dzu_f32(&self) -> u64 {
        match self {
            Operands::F32 { dzu, .. } => dzu.device_ptr(),
            Operands::Bf16 { .. } => 0,
        }
    }

    /// Where the row kernel writes `dZU` in bf16 (0, none, for f32 products).
    fn dzu_bf16(&self) -> u64 {
        match self {
            Operands::F32 { .. } => 0,
            Operands::Bf16 { dzu, .. } => dzu.device_ptr(),
        }
    }

    fn precision(&self) -> Precision {
        match self {
            Operands::F32 { .. } => Precision::F32,
            Operands::Bf16 { .. } => Precision::Bf16,
        }
    }

    /// The device address of element `offset` of `part`.
    fn address(&self, part: Part, offset: usize) -> u64 {
        match (self, part) {
            (Operands::F32 { dzu, .. }, Part::Dzu) => dzu.ptr_at(offset),
            (Operands::F32 { x, .. }, Part::X) => x.ptr_at(offset),
            (Operands::Bf16 { dzu, .. }, Part::Dzu) => dzu.ptr_at(offset),
            (Operands::Bf16 { x, .. }, Part::X) => x.ptr_at(offset),
        }
    }

    /// `part` from element `offset` as a row-major operand with row stride `ld`.
    fn rows(&self, part: Part, offset: usize, ld: usize) -> Operand {
        Operand::rows(self.address(part, offset), ld)
    }

    /// The transpose of [`Operands::rows`].
    fn transposed(&self, part: Part, offset: usize, ld: usize) -> Operand {
        Operand::transposed(self.address(part, offset), ld)
    }
}
