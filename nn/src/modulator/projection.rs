//! A linear projection with gates on its output: `Ẑ = (X·Wᵀ) ⊙ G₁(X) ⊙ G₂(X) ...`
//! (Transponder eq. 6), every gate reading the projection's own input `X`.
//!
//! The `layer-channel-scalar` pair runs as one fused op (eq. 8-10,
//! [`Var::fused_gated_projection`]): one GEMM over `[W | A_cᵀ | A_sᵀ]`, the gate computed
//! and applied in one pass over rows. That is the engine's default and its speed edge; the
//! unfused composite stays for every other gate and for `fused = false`.

use autograd::ops::{GatedProjectionVars, ProductOutput, Unary};
use autograd::{Result, Var};
use tensor::{with_last_dim, Device, Rng};

use super::Gate;
use crate::init::WeightInit;
use crate::layers::Linear;
use crate::module::{join, Module};

/// A bias-free linear layer with an optional list of output gates.
pub struct ModulatedProjection {
    /// The projection `W: [out, in]`, no bias.
    pub linear: Linear,
    /// Gates multiplied onto the output, each reading the projection's input.
    pub gates: Vec<Gate>,
    /// Run a lone [`Gate::ChannelScalar`] through the fused op (default true).
    pub fused: bool,
}

impl ModulatedProjection {
    /// An ungated `in_features → out_features` projection; push gates onto `gates`.
    pub fn new(in_features: usize, out_features: usize, init: WeightInit, rng: &mut Rng) -> ModulatedProjection {
        ModulatedProjection { linear: init.linear(in_features, out_features, rng), gates: Vec::new(), fused: true }
    }

    /// Input width.
    pub fn in_features(&self) -> usize {
        self.linear.weight.shape()[1]
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.linear.out_features()
    }

    /// Whether this is a plain linear map (no gate, no bias): projections of one input then
    /// run as one product of their stacked weights ([`Var::packed_linear`]) where that is one
    /// GEMM (a GPU under bf16 products; elsewhere one by one, which is faster).
    pub fn is_plain(&self) -> bool {
        self.gates.is_empty() && self.linear.bias.is_none()
    }

    /// `x: [..., in] → [..., out]`, through the fused op when the gates allow it, and a plain
    /// projection as one packed product where that is one GEMM (a GPU under bf16 products:
    /// its input gradient is then kept in bf16 alone, as autocast keeps it).
    pub fn forward(&self, x: &Var) -> Result<Var> {
        self.forward_as(x, ProductOutput::F32)
    }

    /// [`ModulatedProjection::forward`], the fused op's or the packed product's result
    /// stored as `output` says ([`ProductOutput`]: bf16 for a consumer that reads bf16, such
    /// as the residual stream's fused add + RMSNorm); the unfused gates' products stay f32.
    pub fn forward_as(&self, x: &Var, output: ProductOutput) -> Result<Var> {
        self.record_gates(x)?;
        self.place_fused_alphas(x.value_ref().device())?;
        match self.fused_parts() {
            Some((parts, phi)) => x.fused_gated_projections(&[parts], phi, output),
            None if self.is_plain() && x.value_ref().packed_linear_is_one_product() => {
                let y = self.flat_rows(x)?.packed_linear(&[&self.linear.weight], output)?;
                y.reshape(&with_last_dim(&x.shape(), self.out_features()))
            }
            None => self.forward_unfused(x),
        }
    }

    /// [`ModulatedProjection::forward_as`] of `x: [..., in]` viewed as `shape`, left to its
    /// reader to run ([`GatedOutput`]) where that reader can run it in one launch with its own
    /// work: the residual stream's add and next RMSNorm ([`GatedOutput::add_rms_norm`]), which
    /// alone reads an output stored in bf16 (`output`). Where the output is bf16, and the
    /// projection is one product (a GPU under bf16 products) and takes the fused op; `None`
    /// otherwise (call `forward_as`). Its gates go to a running trace now.
    pub fn deferred(&self, x: &Var, output: ProductOutput, shape: &[usize]) -> Result<Option<GatedOutput>> {
        if output != ProductOutput::Bf16 {
            return Ok(None);
        }
        // A group of one: the checks, the α's placement and the trace of `fused_group`.
        let Some((group, phi)) = ModulatedProjection::fused_group(&[self], x)? else { return Ok(None) };
        let Some(parts) = group.first() else { return Ok(None) };
        Ok(Some(GatedOutput {
            input: x.clone(),
            weight: parts.weight.clone(),
            channel: parts.channel.map(Var::clone),
            scalar: parts.scalar.map(Var::clone),
            phi,
            shape: shape.to_vec(),
        }))
    }

    /// `projections` of the same `rows: [N, in]` as one op, their outputs side by side
    /// (`[N, Σ out]`), where that is one product (a GPU under bf16 products:
    /// [`tensor::Tensor::packed_linear_is_one_product`]): one GEMM of the stacked weights
    /// when every projection is plain ([`Var::packed_linear`]), or one fused gated group when
    /// every one takes the fused op with one φ and one pair of ranks
    /// ([`Var::fused_gated_projections`]). `None` otherwise: run them one by one. `output`
    /// says how a plain product stores its result ([`ProductOutput`]: bf16 for a consumer
    /// that reads bf16), and a fused group's too.
    pub fn forward_packed(
        projections: &[&ModulatedProjection],
        rows: &Var,
        output: ProductOutput,
    ) -> Result<Option<Var>> {
        if !rows.value_ref().packed_linear_is_one_product() {
            return Ok(None);
        }
        if projections.iter().all(|p| p.is_plain()) {
            let weights: Vec<&Var> = projections.iter().map(|p| &p.linear.weight).collect();
            return rows.packed_linear(&weights, output).map(Some);
        }
        match ModulatedProjection::fused_group(projections, rows)? {
            Some((parts, phi)) => rows.fused_gated_projections(&parts, phi, output).map(Some),
            None => Ok(None),
        }
    }

    /// `projections` of `rows` as one fused gated group ([`Var::fused_gated_projections`]),
    /// their weights and modulators with their φ, where that is one product (a GPU under bf16
    /// products: [`tensor::Tensor::packed_linear_is_one_product`]) and every one takes the
    /// fused op with one φ and one pair of ranks; `None` otherwise. Their gates go to a
    /// running trace.
    pub fn fused_group<'a>(
        projections: &[&'a ModulatedProjection],
        rows: &Var,
    ) -> Result<Option<(Vec<GatedProjectionVars<'a>>, Unary)>> {
        if !rows.value_ref().packed_linear_is_one_product() {
            return Ok(None);
        }
        for p in projections {
            p.place_fused_alphas(rows.value_ref().device())?;
        }
        let fused: Option<Vec<_>> = projections.iter().map(|p| p.fused_parts()).collect();
        let Some(fused) = fused else { return Ok(None) };
        // A group shares one φ and one pair of ranks.
        let ranks = |p: &GatedProjectionVars| (p.channel[0].shape()[0], p.scalar[0].shape()[0]);
        let Some((first, phi)) = fused.first().map(|(p, phi)| (ranks(p), *phi)) else { return Ok(None) };
        if fused.iter().any(|(p, other)| *other != phi || ranks(p) != first) {
            return Ok(None);
        }
        for p in projections {
            p.record_gates(rows)?;
        }
        Ok(Some((fused.into_iter().map(|(parts, _)| parts).collect(), phi)))
    }

    /// This projection's weight and modulators when it runs as the fused op (a lone
    /// [`Gate::ChannelScalar`] whose two φ agree, no bias, `fused` on), with that φ.
    fn fused_parts(&self) -> Option<(GatedProjectionVars<'_>, Unary)> {
        match (self.fused, self.gates.as_slice(), &self.linear.bias) {
            (true, [Gate::ChannelScalar { channel, scalar }], None) if channel.phi == scalar.phi => {
                let parts = GatedProjectionVars {
                    weight: &self.linear.weight,
                    channel: channel.parameters_in_order(),
                    scalar: scalar.parameters_in_order(),
                };
                Some((parts, channel.phi.unary()))
            }
            _ => None,
        }
    }

    /// Puts the fused op's frozen α's (constants, which `Module::to_device` does not move) on
    /// `device`, where the fused op reads them with the other modulator parameters.
    fn place_fused_alphas(&self, device: Device) -> Result<()> {
        if let [Gate::ChannelScalar { channel, scalar }] = self.gates.as_slice() {
            channel.place_frozen_alpha(device)?;
            scalar.place_frozen_alpha(device)?;
        }
        Ok(())
    }

    /// Hands the gates and their input to a running trace (`crate::trace`), if any.
    fn record_gates(&self, x: &Var) -> Result<()> {
        if crate::trace::is_recording() {
            for gate in &self.gates {
                crate::trace::record_gate(gate, x)?;
            }
        }
        Ok(())
    }

    /// `x: [..., in] → [..., out]` composed from unfused ops (matmul, then each gate).
    pub fn forward_unfused(&self, x: &Var) -> Result<Var> {
        let flat = self.flat_rows(x)?;
        let mut y = self.linear.forward(&flat)?;
        for gate in &self.gates {
            y = y.mul(&gate.forward(&flat)?)?;
        }
        y.reshape(&with_last_dim(&x.shape(), self.out_features()))
    }

    /// `x: [..., in]` as `[rows, in]`. Rows already flat are read as they are, so every
    /// projection of one input reads the same graph node and adds its input gradient onto
    /// the others' in its own backward GEMM (`Var::matmul`), where a reshape apiece would
    /// leave the sum to the engine.
    fn flat_rows(&self, x: &Var) -> Result<Var> {
        let shape = x.shape();
        if shape.len() == 2 {
            return Ok(x.clone());
        }
        let rows: usize = shape[..shape.len().saturating_sub(1)].iter().product();
        x.reshape(&[rows, self.in_features()])
    }
}

/// A fused gated projection not yet run ([`ModulatedProjection::deferred`]): its input, its
/// weight and modulators (shared handles, no copies), its φ and its output's shape, for the op
/// that reads its output to run it, alone ([`GatedOutput::value`]) or in one launch with its
/// own work ([`GatedOutput::add_rms_norm`]).
#[derive(Clone)]
pub struct GatedOutput {
    input: Var,
    weight: Var,
    channel: [Var; 5],
    scalar: [Var; 5],
    phi: Unary,
    shape: Vec<usize>,
}

impl GatedOutput {
    fn parts(&self) -> GatedProjectionVars<'_> {
        GatedProjectionVars { weight: &self.weight, channel: self.channel.each_ref(), scalar: self.scalar.each_ref() }
    }

    /// The projection's output in its shape, stored in bf16 ([`Var::fused_gated_projections`]).
    pub fn value(&self) -> Result<Var> {
        self.input.fused_gated_projections(&[self.parts()], self.phi, ProductOutput::Bf16)?.reshape(&self.shape)
    }

    /// `(stream + output, RMSNorm(stream + output))` for `stream` of the output's shape: one op ([`Var::fused_gated_add_rms_norm`], the gate's launch adding and
    /// normalising too), with the same values as [`GatedOutput::value`] then
    /// [`Var::add_rms_norm`].
    pub fn add_rms_norm(&self, stream: &Var, weight: &Var, eps: f32) -> Result<(Var, Var)> {
        self.input.fused_gated_add_rms_norm(self.parts(), self.phi, stream, weight, eps)
    }
}

impl Module for ModulatedProjection {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.linear.weight);
        for gate in &self.gates {
            gate.visit_parameters(prefix, visit);
        }
    }
}
