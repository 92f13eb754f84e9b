//! Row-sparse table updates ([`SparseRows`]): exact for plain SGD (identical to the dense
//! step, only seen rows touched), and "lazy Adam" equal to dense Adam on the seen rows of the
//! first step while unseen rows stay frozen afterwards (where dense Adam keeps moving them).

use autograd::Var;
use nn::optim::{Adam, AdamConfig, Optimizer, RowRule, Sgd, SparseRows};
use nn::NamedParameter;
use tensor::{Device, Rng, Tensor, Tokens};

const VOCAB: usize = 10;
const WIDTH: usize = 3;

/// A table `[V, W]` and a dense weight `[W, 2]`, both trainable.
fn parameters(seed: u64) -> (NamedParameter, NamedParameter) {
    let mut rng = Rng::new(seed);
    let table = Var::parameter(Tensor::rand_normal(&[VOCAB, WIDTH], 0.0, 1.0, &mut rng));
    let dense = Var::parameter(Tensor::rand_normal(&[WIDTH, 2], 0.0, 1.0, &mut rng));
    (NamedParameter { name: "table".into(), var: table }, NamedParameter { name: "dense".into(), var: dense })
}

/// Loss `Σ (E[ids]·W)²` so both parameters get gradients; only rows in `ids` of E do.
fn backward(table: &Var, dense: &Var, ids: &[u32]) {
    let y = table.embedding(&Tokens::new(ids, Device::Cpu).unwrap(), &[ids.len()]).unwrap().matmul(dense).unwrap();
    y.square().unwrap().sum_all().unwrap().backward().unwrap();
}

fn run(optimizer: &mut dyn Optimizer, table: &Var, dense: &Var, batches: &[&[u32]]) {
    for ids in batches {
        optimizer.zero_grad();
        backward(table, dense, ids);
        optimizer.step(0.05).unwrap();
    }
}

#[test]
fn plain_sgd_sparse_update_is_exact() {
    let batches: [&[u32]; 3] = [&[1, 4, 4], &[2, 9], &[4, 7, 1]];
    let (t1, d1) = parameters(1);
    let mut dense = Sgd::new(vec![t1.clone(), d1.clone()], 0.0, 0.0, false);
    run(&mut dense, &t1.var, &d1.var, &batches);

    let (t2, d2) = parameters(1);
    let rule = RowRule::Sgd { momentum: 0.0, weight_decay: 0.0 };
    assert!(rule.is_exact());
    let mut sparse = SparseRows::new(Box::new(Sgd::new(vec![d2.clone()], 0.0, 0.0, false)), vec![t2.clone()], rule);
    run(&mut sparse, &t2.var, &d2.var, &batches);
    assert_eq!(sparse.rows_touched(), 3, "the last batch has three distinct tokens");
    assert_eq!(t1.var.value().to_vec(), t2.var.value().to_vec());
    assert_eq!(d1.var.value().to_vec(), d2.var.value().to_vec());
    assert_eq!(sparse.parameters().len(), 2);
}

#[test]
fn lazy_adam_freezes_unseen_rows() {
    let config = AdamConfig { weight_decay: 0.0, ..AdamConfig::default() };
    let (t1, d1) = parameters(2);
    let mut dense = Adam::new(vec![t1.clone(), d1.clone()], config);
    let (t2, d2) = parameters(2);
    let initial = t2.var.value().to_vec();
    let mut lazy =
        SparseRows::new(Box::new(Adam::new(vec![d2.clone()], config)), vec![t2.clone()], RowRule::Adam(config));
    assert!(!RowRule::Adam(config).is_exact());

    // Step 1: zero moments make dense Adam's update of an unseen row exactly 0, so they agree
    // (to rounding: the kernel's SIMD body and scalar tail split a short row differently).
    run(&mut dense, &t1.var, &d1.var, &[&[0, 3]]);
    run(&mut lazy, &t2.var, &d2.var, &[&[0, 3]]);
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 * (1.0 + x.abs()));
    assert!(close(&t1.var.value().to_vec(), &t2.var.value().to_vec()));

    // Step 2 on other rows: dense Adam still moves rows 0 and 3 (momentum); lazy Adam does not.
    run(&mut dense, &t1.var, &d1.var, &[&[5]]);
    run(&mut lazy, &t2.var, &d2.var, &[&[5]]);
    let (dense_rows, lazy_rows) = (t1.var.value().to_vec(), t2.var.value().to_vec());
    let row = |v: &[f32], r: usize| v[r * WIDTH..(r + 1) * WIDTH].to_vec();
    assert_ne!(row(&dense_rows, 0), row(&lazy_rows, 0));
    assert_eq!(row(&lazy_rows, 8), row(&initial, 8), "a never-seen row never moves");
    assert_ne!(row(&lazy_rows, 5), row(&initial, 5));

    // State round-trips (checkpoints): a fresh optimizer continues identically.
    let state = lazy.state();
    let (t3, d3) = parameters(2);
    t3.var.set_value(t2.var.value()).unwrap();
    d3.var.set_value(d2.var.value()).unwrap();
    let mut resumed =
        SparseRows::new(Box::new(Adam::new(vec![d3.clone()], config)), vec![t3.clone()], RowRule::Adam(config));
    resumed.load_state(&state).unwrap();
    run(&mut lazy, &t2.var, &d2.var, &[&[3, 5]]);
    run(&mut resumed, &t3.var, &d3.var, &[&[3, 5]]);
    assert_eq!(t2.var.value().to_vec(), t3.var.value().to_vec());
}
