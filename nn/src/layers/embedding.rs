//! Token embedding table `[V, C]`.

use autograd::{Result, Var};
use tensor::{Rng, Tokens};

use crate::init;
use crate::module::{join, Module};

/// Looks up rows of a `[vocab, dim]` table (PyTorch `nn.Embedding`, init N(0, 1)·std).
pub struct Embedding {
    /// The table `[vocab, dim]`: row `i` is token `i`'s vector.
    pub weight: Var,
}

impl Embedding {
    /// Normal init with standard deviation `std` (LLaMA uses 0.02).
    pub fn new(vocab: usize, dim: usize, std: f32, rng: &mut Rng) -> Embedding {
        Embedding { weight: init::normal(&[vocab, dim], std, rng) }
    }

    /// `ids` (on the table's device) shaped `ids_shape` → `ids_shape + [dim]`.
    pub fn forward(&self, ids: &Tokens, ids_shape: &[usize]) -> Result<Var> {
        self.weight.embedding(ids, ids_shape)
    }
}

impl Module for Embedding {
    fn visit_parameters(&self, prefix: &str, visit: &mut dyn FnMut(String, &Var)) {
        visit(join(prefix, "weight"), &self.weight);
    }
}
