// The emulator's mutants: kernels with one deliberate bug each, for the emulator's own tests
// (kernels/tests/cuda_emulator.rs): each must make an agreement or bounds test fail. Declared
// once, here: build.rs `include!`s this file to make each mutant's kernel table by one textual
// edit of its family's source (an edit that no longer applies fails the build), and the
// emulated device (emu/mod.rs) runs a mutant in place of its family.

/// A deliberately wrong variant of one kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// `attention_forward` without the barrier between staging a K/V tile and reading it.
    AttentionMissingSync,
    /// The tensor-core attention reading each tile without waiting for its cp.async copies.
    AttentionMmaMissingWait,
    /// `fused_gate_mma_r*` storing accumulator elements d1 of the summary columns' mma
    /// fragment in row g + 8 instead of g (a fragment index off by one).
    FusedGateFragmentRow,
    /// `fill_bias` writing one element past the end of `y`.
    FillBiasPastEnd,
}

/// A mutant's edit: the family's file stem, the mutant's name, and the one text replaced.
pub struct MutantEdit {
    /// The family's `.cu` file without extension.
    pub family: &'static str,
    /// The mutant's name (its kernel table is `mutants/<name>`).
    pub name: &'static str,
    /// The text of the family's source that the edit replaces (exactly one occurrence).
    pub find: &'static str,
    /// What replaces it.
    pub replace: &'static str,
}

impl Mutant {
    /// Every mutant.
    pub const ALL: [Mutant; 4] = [
        Mutant::AttentionMissingSync,
        Mutant::AttentionMmaMissingWait,
        Mutant::FusedGateFragmentRow,
        Mutant::FillBiasPastEnd,
    ];

    /// The edit that makes this mutant from its family's source.
    pub fn edit(self) -> MutantEdit {
        match self {
            Mutant::AttentionMissingSync => MutantEdit {
                family: "attention",
                name: "attention_missing_sync",
                find: "        __syncthreads();\n        if (!active || s0 > position) continue;  // warp-uniform",
                replace: "        if (!active || s0 > position) continue;  // warp-uniform",
            },
            Mutant::AttentionMmaMissingWait => MutantEdit {
                family: "attention_mma",
                name: "attention_mma_missing_wait",
                find: "    cp_async_commit();\n    cp_async_wait<1>();\n    __syncthreads();",
                replace: "    cp_async_commit();\n    __syncthreads();",
            },
            Mutant::FusedGateFragmentRow => MutantEdit {
                family: "fused_gate",
                name: "fused_gate_fragment_row",
                find: "int row = warp * 16 + g + (e >= 2 ? 8 : 0);",
                replace: "int row = warp * 16 + g + (e >= 1 ? 8 : 0);",
            },
            Mutant::FillBiasPastEnd => MutantEdit {
                family: "conv",
                name: "fill_bias_past_end",
                find: "GRID_STRIDE(i, n) { y[i] = bias[(i / positions) % out_channels]; }",
                replace: "GRID_STRIDE(i, n + 1) { y[i] = bias[(i / positions) % out_channels]; }",
            },
        }
    }
}
