//! The readers of the larger real datasets: MNIST / Fashion-MNIST IDX files (plain and
//! gzipped, every corruption a clear error), a ResNet run on them, and `prepare` of several
//! gzipped texts into one token set with a per-file validation split. The last tests read
//! the shared copies in `../shared/data/` and skip, saying so, where that is absent.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use trainer::data::images::{Normalization, Split};
use trainer::data::token_file::TokenFile;
use trainer::data::{load_idx, load_idx_dir, ImageDataset};
use trainer::prepare::{prepare, prepare_split, ValSplit};
use trainer::tokenizer::Tokenizer;
use trainer::train_image::{train_image, ImageTrainConfig};

fn err_text<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    path
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

/// An IDX file of unsigned bytes with the given sizes and elements.
fn idx(dims: &[u32], elements: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        out.extend(d.to_be_bytes());
    }
    out.extend(elements);
    out
}

/// `n` images of `h × w` whose pixel `(i, y, x)` is `(31 i + 7 y + x) mod 256`, labels `i mod 10`.
fn idx_pair(n: usize, h: usize, w: usize) -> (Vec<u8>, Vec<u8>) {
    let pixels: Vec<u8> =
        (0..n).flat_map(|i| (0..h * w).map(move |p| ((31 * i + 7 * (p / w) + p % w) % 256) as u8)).collect();
    let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
    (idx(&[n as u32, h as u32, w as u32], &pixels), idx(&[n as u32], &labels))
}

fn all_pixels(set: &ImageDataset) -> Vec<u8> {
    (0..set.len()).flat_map(|i| set.pixels(i).unwrap().to_vec()).collect()
}

#[test]
fn idx_files_load_plain_mapped_and_gzipped_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (images, labels) = idx_pair(12, 5, 4);
    let plain = load_idx(&write(dir.path(), "i", &images), &write(dir.path(), "l", &labels)).unwrap();
    assert_eq!((plain.len(), plain.channels(), plain.height(), plain.width()), (12, 1, 5, 4));
    assert_eq!(plain.num_classes(), 10);
    assert_eq!(plain.labels(), (0..12).map(|i| i % 10).collect::<Vec<u32>>());
    assert_eq!(all_pixels(&plain), images[16..]);
    assert_eq!(plain.pixels(3).unwrap()[..3], [93, 94, 95]);
    assert!(plain.pixels(12).is_none());

    let gzipped = load_idx(&write(dir.path(), "i.gz", &gzip(&images)), &write(dir.path(), "l.gz", &gzip(&labels)));
    let gzipped = gzipped.unwrap();
    assert_eq!(gzipped.labels(), plain.labels());
    assert_eq!(all_pixels(&gzipped), all_pixels(&plain));
    // Pixels are 0..=255: the normalisation divides by 255, as for CIFAR.
    let norm = Normalization::from_dataset(&plain);
    let mean = images[16..].iter().map(|&p| f64::from(p)).sum::<f64>() / (12.0 * 20.0 * 255.0);
    assert!((f64::from(norm.mean[0]) - mean).abs() < 1e-6);

    let head = plain.first_images(5);
    assert_eq!((head.len(), head.labels()), (5, &plain.labels()[..5]));
    assert_eq!(plain.first_images(0).len(), 12);
    assert_eq!(plain.first_images(100).len(), 12);
}

#[test]
fn an_idx_directory_uses_plain_files_before_gzipped_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (train_images, train_labels) = idx_pair(6, 3, 3);
    let (test_images, test_labels) = idx_pair(4, 3, 3);
    write(dir.path(), "train-images-idx3-ubyte.gz", &gzip(&train_images));
    write(dir.path(), "train-labels-idx1-ubyte.gz", &gzip(&train_labels));
    write(dir.path(), "t10k-images-idx3-ubyte", &test_images);
    write(dir.path(), "t10k-labels-idx1-ubyte", &test_labels);
    assert_eq!(load_idx_dir(dir.path(), Split::Train).unwrap().len(), 6);
    assert_eq!(load_idx_dir(dir.path(), Split::Test).unwrap().len(), 4);
    // A plain file next to a damaged .gz is the one read.
    write(dir.path(), "t10k-images-idx3-ubyte.gz", b"\x1f\x8bnot really gzip");
    assert_eq!(load_idx_dir(dir.path(), Split::Test).unwrap().len(), 4);
    fs::remove_file(dir.path().join("t10k-labels-idx1-ubyte")).unwrap();
    let msg = err_text(load_idx_dir(dir.path(), Split::Test));
    assert!(msg.contains("t10k-labels-idx1-ubyte") && msg.contains(".gz"), "{msg}");
}

#[test]
fn corrupt_idx_files_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (images, labels) = idx_pair(5, 4, 4);
    let good_images = write(d, "good-i", &images);
    let good_labels = write(d, "good-l", &labels);
    let check = |images: &Path, labels: &Path, expected: &[&str]| {
        let msg = err_text(load_idx(images, labels));
        for part in expected {
            assert!(msg.contains(part), "`{msg}` does not mention `{part}`");
        }
    };
    check(&write(d, "truncated", &images[..images.len() - 3]), &good_labels, &["truncated", "77 bytes"]);
    check(&write(d, "empty", b""), &good_labels, &["empty"]);
    check(&write(d, "csv", b"1,2,3\n"), &good_labels, &["csv", "not an IDX file"]);
    let mut floats = images.clone();
    floats[2] = 0x0D;
    check(&write(d, "floats", &floats), &good_labels, &["floats", "0x0d", "unsigned bytes"]);
    check(&good_labels, &good_images, &["good-i", "3 dimensions", "a label file has 1", "swapped"]);
    check(&write(d, "header", &images[..9]), &good_labels, &["header", "inside its header"]);
    check(&write(d, "zero", &idx(&[0, 4, 4], &[])), &good_labels, &["zero", "zero size"]);
    let mut bad_label = labels.clone();
    bad_label[8 + 3] = 10;
    check(&good_images, &write(d, "bad-label", &bad_label), &["bad-label", "item 3", "label 10"]);
    let (_, six_labels) = idx_pair(6, 4, 4);
    check(&good_images, &write(d, "six", &six_labels), &["5 images", "6 labels"]);
    let mut damaged = gzip(&images);
    damaged.truncate(damaged.len() / 2);
    check(&write(d, "damaged.gz", &damaged), &good_labels, &["damaged.gz", "gzip"]);
    check(&d.join("missing"), &good_labels, &["missing"]);
}

#[test]
fn a_resnet_trains_on_idx_files_and_evaluates_on_the_test_split() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    fs::create_dir_all(&data).unwrap();
    let (train_images, train_labels) = idx_pair(80, 8, 8);
    let (test_images, test_labels) = idx_pair(20, 8, 8);
    write(&data, "train-images-idx3-ubyte.gz", &gzip(&train_images));
    write(&data, "train-labels-idx1-ubyte.gz", &gzip(&train_labels));
    write(&data, "t10k-images-idx3-ubyte", &test_images);
    write(&data, "t10k-labels-idx1-ubyte", &test_labels);
    let config = ImageTrainConfig {
        dataset: "fashion-mnist".into(),
        data_dir: data,
        base_width: 4,
        batch_size: 16,
        epochs: 1,
        train_images: 48,
        out_dir: dir.path().join("run"),
        ..ImageTrainConfig::default()
    };
    assert!(config.augmentation().is_some(), "Fashion-MNIST is augmented by default");
    assert!(ImageTrainConfig { dataset: "mnist".into(), ..config.clone() }.augmentation().is_none());
    let (train, eval) = config.datasets().unwrap();
    assert_eq!((train.len(), eval.len()), (48, 20));
    let report = train_image(&config, false).unwrap();
    assert_eq!((report.epochs, report.steps), (1, 3), "48 images of batch 16 are 3 steps");
    assert!(report.final_loss.is_finite() && report.final_accuracy().is_finite());
    let unknown = ImageTrainConfig { dataset: "emnist".into(), ..config };
    let msg = err_text(unknown.validate());
    assert!(msg.contains("emnist") && msg.contains("fashion-mnist") && msg.contains("mnist"), "{msg}");
}

fn read_all(path: &Path) -> Vec<u32> {
    let file = TokenFile::open(path).unwrap();
    let mut out = vec![0; file.len()];
    file.copy_window(0, file.len(), &mut out).unwrap();
    out
}

#[test]
fn prepare_reads_gzipped_texts_and_can_hold_out_each_files_tail() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a_text = "alpha beta gamma delta\n".repeat(10);
    let b_text = "one two three four five six\n".repeat(20);
    let a = write(d, "a.txt.gz", &gzip(a_text.as_bytes()));
    let b = write(d, "b.txt", b_text.as_bytes());
    let byte = Tokenizer::Byte;

    let stream = prepare(&[a.clone(), b.clone()], &byte, &d.join("stream"), 0.1).unwrap();
    assert_eq!(stream.input_bytes as usize, a_text.len() + b_text.len(), "gzip is counted decompressed");
    let mut all = read_all(&stream.train_path);
    all.extend(read_all(&stream.val_path));
    assert_eq!(byte.decode(&all), format!("{a_text}{b_text}"));

    let each = prepare_split(&[a, b], &byte, &d.join("each"), 0.1, ValSplit::EachFileTail).unwrap();
    let (a_val, b_val) = ((a_text.len() as f64 * 0.1).round() as usize, (b_text.len() as f64 * 0.1).round() as usize);
    assert_eq!((each.val_tokens, each.train_tokens), (a_val + b_val, a_text.len() + b_text.len() - a_val - b_val));
    let train = byte.decode(&read_all(&each.train_path));
    let val = byte.decode(&read_all(&each.val_path));
    let (a_cut, b_cut) = (a_text.len() - a_val, b_text.len() - b_val);
    assert_eq!(train, format!("{}{}", &a_text[..a_cut], &b_text[..b_cut]));
    assert_eq!(val, format!("{}{}", &a_text[a_cut..], &b_text[b_cut..]));

    let gpt2 = Tokenizer::from_name("gpt2").unwrap();
    let eot = gpt2.eot_token().unwrap();
    let marked = prepare_split(
        &[write(d, "c.txt", a_text.as_bytes()), write(d, "e.txt", b_text.as_bytes())],
        &gpt2,
        &d.join("gpt2"),
        0.2,
        ValSplit::EachFileTail,
    )
    .unwrap();
    let val = read_all(&marked.val_path);
    assert_eq!(val.iter().filter(|&&t| t == eot).count(), 2, "each file's held-out tail starts a document");
    assert_eq!(val[0], eot);

    let msg = err_text(prepare(&[write(d, "bad.gz", b"\x1f\x8b\x08garbage")], &byte, &d.join("bad"), 0.1));
    assert!(msg.contains("bad.gz") && msg.contains("gzip"), "{msg}");
}

/// `../shared/data/<name>` next to the repository, or `None` with a note that the test skips.
fn shared_data(name: &str) -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data").join(name);
    if path.is_dir() {
        Some(path)
    } else {
        eprintln!("skipping: {} is absent (data/fetch.sh gets it)", path.display());
        None
    }
}

#[test]
fn the_shared_fashion_mnist_is_complete() {
    let Some(dir) = shared_data("fashion-mnist") else { return };
    for (split, n) in [(Split::Train, 60_000), (Split::Test, 10_000)] {
        let set = load_idx_dir(&dir, split).unwrap();
        assert_eq!((set.len(), set.channels(), set.height(), set.width()), (n, 1, 28, 28));
        let mut per_class = [0usize; 10];
        set.labels().iter().for_each(|&l| per_class[l as usize] += 1);
        assert_eq!(per_class, [n / 10; 10], "Fashion-MNIST is balanced");
    }
}

#[test]
fn the_shared_english_corpus_prepares_with_every_source_in_validation() {
    let Some(dir) = shared_data("english") else { return };
    let inputs: Vec<PathBuf> = ["gutenberg18", "sotu", "brown"].map(|n| dir.join(format!("{n}.txt.gz"))).to_vec();
    let out = tempfile::tempdir().unwrap();
    let report = prepare_split(&inputs, &Tokenizer::Byte, out.path(), 0.1, ValSplit::EachFileTail).unwrap();
    assert_eq!(report.input_bytes, 28_684_318);
    // 10% of each text's bytes (11,793,325, 10,761,879 and 6,129,114), rounded.
    assert_eq!(report.val_tokens, 1_179_333 + 1_076_188 + 612_911);
    assert_eq!(report.train_tokens + report.val_tokens, 28_684_318);
    let val = Tokenizer::Byte.decode(&read_all(&report.val_path));
    // The tails of the sources: Whitman's Leaves of Grass, a 2021 address, Brown's science fiction.
    for tail in ["Leaves of Grass", "Biden", "Sweeneys"] {
        assert!(val.contains(tail), "validation lacks `{tail}`");
    }
}
