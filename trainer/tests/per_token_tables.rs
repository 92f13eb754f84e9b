//! Per-token tables in training: `per-token` and `token-scale` train through
//! `trainer::train::train`, and their row-sparse updates touch only rows of tokens in the
//! data (lazy AdamW; plain SGD, where it is exact), while dense AdamW moves every row.

use std::path::{Path, PathBuf};

use trainer::checkpoint;
use trainer::config::TrainConfig;
use trainer::data::token_file::write_llmc;
use trainer::train::{train, CHECKPOINT_FILE};

const TEXT: &str = "to be or not to be, that is the question. ";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("transponder-tables-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Trains 3 steps and returns the table parameter named `*suffix` of layer 0 as rows.
fn trained_table(dir: &Path, variant: &str, suffix: &str, change: impl FnOnce(&mut TrainConfig)) -> Vec<Vec<f32>> {
    let tokens: Vec<u32> = TEXT.repeat(40).bytes().map(u32::from).collect();
    let data = dir.join("train.bin");
    write_llmc(&data, &tokens, 256).unwrap();
    let mut config = TrainConfig {
        variant: variant.into(),
        train_data: Some(data.clone()),
        val_data: Some(data),
        batch_size: 2,
        seq_len: 16,
        steps: 3,
        warmup: 1,
        eval_every: 0,
        eval_batches: 1,
        save_every: 0,
        log_every: 3,
        out_dir: dir.join("run"),
        ..TrainConfig::default()
    };
    change(&mut config);
    let report = train(&config, false).unwrap();
    assert!(report.final_loss.is_finite());
    let saved = checkpoint::load(&config.out_dir.join(CHECKPOINT_FILE)).unwrap();
    let table = saved.weights.iter().find(|t| t.name == format!("model.layers.0.{suffix}")).unwrap();
    table.data.chunks(table.data.len() / table.shape[0]).map(<[f32]>::to_vec).collect()
}

/// Rows of byte values that never occur in TEXT.
fn unseen() -> Vec<usize> {
    (0..256).filter(|b| !TEXT.as_bytes().contains(&(*b as u8))).collect()
}

#[test]
fn token_scale_rows_of_unseen_tokens_stay_put_with_sparse_updates() {
    let dir = scratch("token-scale");
    let lazy = trained_table(&dir, "token-scale", "token_scale.weight", |c| c.lazy_tables = true);
    assert!(unseen().iter().all(|&r| lazy[r].iter().all(|&v| v == 1.0)), "lazy AdamW moved an unseen row");
    assert!(lazy[b't' as usize].iter().any(|&v| v != 1.0), "a seen row must move");
    let dense = trained_table(&dir, "token-scale", "token_scale.weight", |_| {});
    // Dense AdamW decays every matrix row, seen or not.
    assert!(unseen().iter().all(|&r| dense[r].iter().all(|&v| v < 1.0)));
    let sgd = trained_table(&dir, "token-scale", "token_scale.weight", |c| {
        c.optimizer = trainer::config::OptimizerKind::Sgd;
        c.momentum = 0.0;
        c.weight_decay = 0.0;
        c.lr = 0.1;
    });
    assert!(unseen().iter().all(|&r| sgd[r].iter().all(|&v| v == 1.0)));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn per_token_transform_trains_with_lazy_tables() {
    let dir = scratch("per-token");
    let table = trained_table(&dir, "per-token", "per_token.table", |c| c.lazy_tables = true);
    let rank = (table[0].len() as f64).sqrt() as usize;
    assert_eq!(rank, 11, "round(√128)");
    let identity: Vec<f32> = (0..rank * rank).map(|i| f32::from(u8::from(i % (rank + 1) == 0))).collect();
    assert!(unseen().iter().all(|&r| table[r] == identity));
    // U starts at 0, so M gets no gradient on the first step; by step 3 the seen rows move.
    assert!(table[b'o' as usize] != identity);
    std::fs::remove_dir_all(&dir).unwrap();
}
