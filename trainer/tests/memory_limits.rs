//! Sizes that cannot fit are errors before anything is allocated: a model larger than the
//! machine's memory (`--d-model`, `--rank`, `train-image --base-width`) and an `eval` batch
//! larger than its file, where the process used to abort on a failed allocation.

mod common;

use common::*;

#[test]
fn sizes_that_cannot_fit_are_errors_not_aborts() {
    let dir = scratch("memory", "sizes");
    let out = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &out, 1)));
    let checkpoint = out.join("checkpoint.safetensors").display().to_string();
    let cases = [
        (set_flag(tiny_train(&dir, &dir.join("wide"), 1), "--d-model", "1000000"), "memory"),
        (
            set_flag(
                set_flag(tiny_train(&dir, &dir.join("rank"), 1), "--variant", "transponder"),
                "--rank",
                "1000000000",
            ),
            "memory",
        ),
        (strings(&["train-image", "--epochs", "1", "--base-width", "1000000", "--out-dir", "image"]), "memory"),
        (set_flag(tiny_train(&dir, &dir.join("batch"), 1), "--batch-size", "100000000"), "memory"),
        (strings(&["eval", &checkpoint, "val.bin", "--batch-size", "100000000"]), "--batch-size"),
    ];
    for (args, needle) in cases {
        let output = run(&dir, &args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {}", stderr(&output));
        assert_fails_with(&output, &[needle]);
    }
}

/// A field of `/proc/self/status` (`VmHWM`, `VmRSS`), in bytes.
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let value = status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).unwrap();
    value.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// How far `work` raised this process's peak resident memory. Measurements take turns (the
/// tests of this file run in one process), and the peak is reset first where the kernel
/// allows (`/proc/self/clear_refs`), so an earlier test's peak cannot hide this one's.
fn peak_growth(work: impl FnOnce()) -> u64 {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = if reset { status_bytes("VmRSS") } else { status_bytes("VmHWM") };
    work();
    status_bytes("VmHWM").saturating_sub(before)
}

#[test]
fn a_gzipped_idx_file_is_not_inflated_past_what_its_header_declares() {
    use std::io::Write;
    let dir = scratch("memory", "idx");
    // One 28×28 image declared, 256 MiB of pixels behind it: 256 KiB of gzip.
    let mut images = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    images.write_all(&[0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 28, 0, 0, 0, 28]).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..256 {
        images.write_all(&zeros).unwrap();
    }
    let (images_path, labels_path) = (dir.join("images.gz"), dir.join("labels"));
    std::fs::write(&images_path, images.finish().unwrap()).unwrap();
    std::fs::write(&labels_path, [0, 0, 8, 1, 0, 0, 0, 1, 3]).unwrap();
    let mut loaded = None;
    let grown = peak_growth(|| loaded = Some(trainer::data::idx::load_idx(&images_path, &labels_path)));
    let Some(Err(error)) = loaded else { panic!("a bomb was accepted") };
    assert!(format!("{error:#}").contains("images.gz"), "{error:#}");
    assert!(grown < 64 << 20, "inflating the file took {} MiB", grown >> 20);
}

#[test]
fn prepare_streams_its_input_in_memory_independent_of_its_size() {
    let dir = scratch("memory", "prepare");
    let text = dir.join("big.txt");
    let line = "to be or not to be, that is the question; whether tis nobler in the mind to suffer\n";
    let mut file = std::io::BufWriter::new(std::fs::File::create(&text).unwrap());
    for _ in 0..(32 << 20) / line.len() {
        std::io::Write::write_all(&mut file, line.as_bytes()).unwrap();
    }
    drop(file);
    let out = dir.join("out");
    let mut prepared = None;
    let grown = peak_growth(|| {
        prepared = Some(trainer::prepare::prepare(&[text], &trainer::tokenizer::Tokenizer::Byte, &out, 0.1))
    });
    let report = prepared.unwrap().unwrap();
    assert!(report.train_tokens + report.val_tokens > 30 << 20);
    assert!(grown < 48 << 20, "preparing 32 MiB of text took {} MiB", grown >> 20);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_device_is_refused_as_a_prepare_input() {
    let dir = scratch("memory", "device");
    let output = run(&dir, &strings(&["prepare", "/dev/zero", "--out", "prepared"]));
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert_fails_with(&output, &["/dev/zero", "device"]);
    assert!(!dir.join("prepared").exists(), "a refused prepare leaves no directory");
}
