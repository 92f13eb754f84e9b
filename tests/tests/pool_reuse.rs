//! Buffer reuse (`tensor::pool`) must never leak stale values into results: ops that take
//! a recycled buffer overwrite every element, ops that accumulate get zeros.
//!
//! The check runs a training step's forward and backward at sizes the pool keeps (≥ 4096
//! elements) with poisoning on: every recycled buffer is handed out full of NaN, so a
//! kernel reading an element it did not write turns the loss or a gradient into NaN. Steps
//! are repeated (later steps reuse the earlier steps' buffers) and must agree bit for bit.

use autograd::Var;
use tensor::ops::Unary;
use tensor::{Device, Rng, Tensor, Tokens};

const BATCH: usize = 2;
const SEQ: usize = 48;
const HEADS: usize = 4;
const HEAD_DIM: usize = 16;
const WIDTH: usize = HEADS * HEAD_DIM;
const VOCAB: usize = 96;
const RANK: usize = 4;

/// Parameters of a one-block model touching every op family the LLaMA step uses.
struct Model {
    embedding: Var,
    norm: Var,
    wqkv: [Var; 3],
    wo: Var,
    ln_weight: Var,
    ln_bias: Var,
    gated: Var,
    channel: [Var; 5],
    scalar: [Var; 5],
    head: Var,
}

impl Model {
    fn new(rng: &mut Rng) -> Model {
        let mut normal = |shape: &[usize], std: f32| Var::parameter(Tensor::rand_normal(shape, 0.0, std, rng));
        let s = 1.0 / (WIDTH as f32).sqrt();
        let wqkv = [normal(&[WIDTH, WIDTH], s), normal(&[WIDTH, WIDTH], s), normal(&[WIDTH, WIDTH], s)];
        let mut modulator = |m: usize| {
            [
                normal(&[RANK, WIDTH], s),
                normal(&[RANK], 0.1),
                normal(&[m, RANK], 0.5),
                normal(&[m], 0.1),
                Var::parameter(Tensor::full(&[1], 1.0)),
            ]
        };
        let (channel, scalar) = (modulator(WIDTH), modulator(1));
        Model {
            embedding: normal(&[VOCAB, WIDTH], 1.0),
            norm: normal(&[WIDTH], 1.0),
            wqkv,
            wo: normal(&[WIDTH, WIDTH], s),
            ln_weight: normal(&[WIDTH], 1.0),
            ln_bias: normal(&[WIDTH], 0.1),
            gated: normal(&[WIDTH, WIDTH], s),
            channel,
            scalar,
            head: normal(&[WIDTH, VOCAB], s),
        }
    }

    fn params(&self) -> Vec<&Var> {
        let mut all =
            vec![&self.embedding, &self.norm, &self.wo, &self.ln_weight, &self.ln_bias, &self.gated, &self.head];
        all.extend(self.wqkv.iter().chain(&self.channel).chain(&self.scalar));
        all
    }

    fn loss(&self, ids: &Tokens, targets: &[u32]) -> tensor::Result<Var> {
        let x = self.embedding.embedding(ids, &[BATCH, SEQ])?;
        let h = x.rms_norm(&self.norm, 1e-5)?;
        let heads = |w: &Var| h.matmul(w)?.reshape(&[BATCH, SEQ, HEADS, HEAD_DIM]);
        let q = heads(&self.wqkv[0])?.rope(10_000.0, 0)?;
        let k = heads(&self.wqkv[1])?.rope(10_000.0, 0)?;
        let v = heads(&self.wqkv[2])?;
        let attended = Var::causal_attention(&q, &k, &v, 1.0 / (HEAD_DIM as f32).sqrt())?;
        let x = x.add(&attended.reshape(&[BATCH, SEQ, WIDTH])?.matmul(&self.wo)?)?;
        let h = x.layer_norm(Some(&self.ln_weight), Some(&self.ln_bias), 1e-5)?.reshape(&[BATCH * SEQ, WIDTH])?;
        let channel: [&Var; 5] = std::array::from_fn(|i| &self.channel[i]);
        let scalar: [&Var; 5] = std::array::from_fn(|i| &self.scalar[i]);
        let gated = h.fused_gated_projection(&self.gated, channel, scalar, Unary::Sigmoid)?;
        // Softmax over tokens: a transposed (non-contiguous) input is copied first.
        let mixed = gated.swiglu(&h.transpose(0, 1)?.softmax()?.transpose(0, 1)?)?.sub(&gated.silu()?)?;
        let x = x.reshape(&[BATCH * SEQ, WIDTH])?.add(&mixed)?;
        x.matmul(&self.head)?.cross_entropy(targets, None)
    }
}

/// The loss and every gradient, flattened.
fn loss_and_grads(model: &Model, ids: &Tokens, targets: &[u32]) -> (f32, Vec<Vec<f32>>) {
    let params = model.params();
    for p in &params {
        p.zero_grad();
    }
    let loss = model.loss(ids, targets).unwrap();
    loss.backward().unwrap();
    let grads = params.iter().map(|p| p.grad().expect("every parameter gets a gradient").to_vec()).collect();
    (loss.value().item().unwrap(), grads)
}

#[test]
fn training_step_is_identical_with_recycled_buffers() {
    let mut rng = Rng::new(7);
    let model = Model::new(&mut rng);
    let ids: Vec<u32> = (0..BATCH * SEQ).map(|_| rng.below(VOCAB as u64) as u32).collect();
    let ids = Tokens::new(&ids, Device::Cpu).unwrap();
    let targets: Vec<u32> = (0..BATCH * SEQ).map(|_| rng.below(VOCAB as u64) as u32).collect();
    tensor::pool::poison_reused_buffers(true);
    let first = loss_and_grads(&model, &ids, &targets);
    assert!(first.0.is_finite(), "loss {}", first.0);
    for (i, grad) in first.1.iter().enumerate() {
        assert!(grad.iter().all(|g| g.is_finite()), "parameter {i}: a non-finite gradient");
    }
    for _ in 0..2 {
        assert_eq!(loss_and_grads(&model, &ids, &targets), first, "a recycled buffer changed the result");
    }
}
