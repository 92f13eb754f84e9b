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

/// This process's peak resident memory (`VmHWM`), in bytes.
fn peak_resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kib * 1024
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
    let before = peak_resident_bytes();
    let Err(error) = trainer::data::idx::load_idx(&images_path, &labels_path) else { panic!("a bomb was accepted") };
    let grown = peak_resident_bytes().saturating_sub(before);
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
    let before = peak_resident_bytes();
    let report =
        trainer::prepare::prepare(&[text], &trainer::tokenizer::Tokenizer::Byte, &dir.join("out"), 0.1).unwrap();
    let grown = peak_resident_bytes().saturating_sub(before);
    assert!(report.train_tokens + report.val_tokens > 30 << 20);
    assert!(grown < 48 << 20, "preparing 32 MiB of text took {} MiB", grown >> 20);
    std::fs::remove_dir_all(&dir).unwrap();
}
