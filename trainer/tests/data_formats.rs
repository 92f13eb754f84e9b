//! Data formats end to end: token files of every kind and every corrupt case, samplers
//! (determinism, exact resume), `prepare`, the shipped digits set, and CIFAR readers on
//! generated files, including augmentation and the shuffled loader.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use trainer::data::token_file::{LLMC_GPT2_MAGIC, LLMC_HEADER_BYTES, LLMC_LLAMA3_MAGIC};
use trainer::data::{
    check_vocab, load_cifar10, load_cifar100, load_cifar100_dir, load_cifar10_dir, load_digits_csv_gz, write_llmc,
    write_nanogpt_raw, Augmentation, BatchSampler, Cifar100Labels, DataFormat, ImageLoader, Normalization,
    RandomSampler, SequentialSampler, Shard, Split, SplitMix64, TokenFile, TokenFormat,
};
use trainer::prepare::{prepare, MIN_SPLIT_TOKENS, PROGRESS_BAR_MIN_BYTES};
use trainer::tokenizer::Tokenizer;

fn err_text<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.unwrap_err())
}

/// Bytes of an llm.c file built by hand from the spec (independent of the writer).
fn llmc_bytes(magic: i32, version: i32, count: i32, tokens: &[u32], width: usize) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[magic, version, count]);
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    for &t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes()[..width]);
    }
    bytes
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    path
}

fn read_all(file: &TokenFile) -> Vec<u32> {
    let mut out = vec![0; file.len()];
    file.copy_window(0, file.len(), &mut out).unwrap();
    out
}

// ---------------------------------------------------------------- token files

#[test]
fn nanogpt_raw_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.bin");
    let tokens: Vec<u16> = vec![0, 1, 65535, 50256, 7];
    write_nanogpt_raw(&path, &tokens).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().len(), 10);
    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.format(), TokenFormat::NanoGptRaw);
    assert_eq!(f.len(), 5);
    assert_eq!(f.get(2), Some(65535));
    assert_eq!(f.get(5), None);
    assert_eq!(f.max_token(), 65535);
    let mut w = [0u32; 3];
    f.copy_window(2, 3, &mut w).unwrap();
    assert_eq!(w, [65535, 50256, 7]);
}

#[test]
fn llmc_gpt2_kind_written_for_small_vocab_and_matches_the_spec_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bin");
    let tokens = [50256u32, 15496, 995, 0];
    write_llmc(&path, &tokens, 50257).unwrap();
    let bytes = fs::read(&path).unwrap();
    assert_eq!(bytes, llmc_bytes(20240520, 1, 4, &tokens, 2));
    assert!(!trainer::safetensors_io::temp_path_for(&path).unwrap().exists());
    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.format(), TokenFormat::LlmcGpt2);
    assert_eq!(read_all(&f), tokens);
}

#[test]
fn llmc_llama3_kind_written_for_large_vocab() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bin");
    let tokens = [128_000u32, 65_536, 3, 128_255];
    write_llmc(&path, &tokens, 128_256).unwrap();
    let bytes = fs::read(&path).unwrap();
    assert_eq!(bytes, llmc_bytes(20240801, 7, 4, &tokens, 4));
    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.format(), TokenFormat::LlmcLlama3);
    assert_eq!(read_all(&f), tokens);
    assert_eq!(f.max_token(), 128_255);
    // The boundary: a vocabulary of exactly 65,536 no longer fits the GPT-2 kind's rule.
    write_llmc(&path, &[65_535], 65_536).unwrap();
    assert_eq!(TokenFile::open(&path).unwrap().format(), TokenFormat::LlmcLlama3);
    write_llmc(&path, &[65_534], 65_535).unwrap();
    assert_eq!(TokenFile::open(&path).unwrap().format(), TokenFormat::LlmcGpt2);
}

#[test]
fn hand_made_llmc_files_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 1, 3, &[9, 8, 7], 2));
    assert_eq!(read_all(&TokenFile::open(&a).unwrap()), [9, 8, 7]);
    let b = write(dir.path(), "b.bin", &llmc_bytes(LLMC_LLAMA3_MAGIC, 7, 2, &[1 << 20, 5], 4));
    assert_eq!(read_all(&TokenFile::open(&b).unwrap()), [1 << 20, 5]);
}

#[test]
fn explicit_format_overrides_detection() {
    let dir = tempfile::tempdir().unwrap();
    // A raw u16 file whose first two tokens spell the GPT-2 magic.
    let magic = LLMC_GPT2_MAGIC.to_le_bytes();
    let path = write(dir.path(), "raw.bin", &[magic[0], magic[1], magic[2], magic[3], 1, 0]);
    assert!(TokenFile::open(&path).is_err());
    let f = TokenFile::open_as(&path, TokenFormat::NanoGptRaw).unwrap();
    assert_eq!(f.len(), 3);
    assert_eq!(f.get(2), Some(1));
    let msg = err_text(TokenFile::open_as(&path, TokenFormat::LlmcLlama3));
    assert!(msg.contains("too short"), "{msg}");
}

#[test]
fn corrupt_token_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: Vec<(PathBuf, &str)> = vec![
        (d.join("missing.bin"), "opening token file"),
        (write(d, "empty.bin", b""), "empty"),
        (write(d, "odd.bin", &[1, 2, 3]), "odd length"),
        (
            write(d, "truncated.bin", &{
                let mut b = llmc_bytes(LLMC_GPT2_MAGIC, 1, 4, &[1, 2, 3, 4], 2);
                b.truncate(b.len() - 2);
                b
            }),
            "header says 4 tokens",
        ),
        (write(d, "overlong.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 1, 2, &[1, 2, 3], 2)), "header says 2 tokens"),
        (
            write(d, "partial.bin", &{
                let mut b = llmc_bytes(LLMC_LLAMA3_MAGIC, 7, 2, &[1, 2], 4);
                b.pop();
                b
            }),
            "partial token",
        ),
        (write(d, "negative.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 1, -1, &[], 2)), "header says -1 tokens"),
        (write(d, "version.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 7, 1, &[1], 2)), "unknown version 7"),
        (write(d, "version3.bin", &llmc_bytes(LLMC_LLAMA3_MAGIC, 1, 1, &[1], 4)), "unknown version 1"),
        (write(d, "short.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 1, 0, &[], 2)[..100]), "too short"),
        (write(d, "no_tokens.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 1, 0, &[], 2)), "no tokens"),
    ];
    for (path, expected) in cases {
        let msg = err_text(TokenFile::open(&path));
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(msg.contains(expected), "{name}: `{msg}` lacks `{expected}`");
        assert!(msg.contains(&name), "{name}: `{msg}` does not name the file");
    }
    let bad_magic = write(d, "magic.bin", &llmc_bytes(1234, 1, 1, &[1], 2));
    let msg = err_text(TokenFile::open_as(&bad_magic, TokenFormat::LlmcGpt2));
    assert!(msg.contains("bad magic 1234"), "{msg}");
    assert_eq!(LLMC_HEADER_BYTES, 1024);
}

#[test]
fn an_llmc_header_with_an_unknown_magic_or_version_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // One flipped bit in the magic, a newer version, both: never 512 header "tokens".
    for (name, magic, version, tokens, width) in [
        ("flipped.bin", LLMC_GPT2_MAGIC ^ 1, 1, vec![1, 2, 3], 2),
        ("newer.bin", 20250101, 2, vec![70_000, 2], 4),
        ("both.bin", 0x0102_0304, 9, vec![9], 2),
    ] {
        let path = write(d, name, &llmc_bytes(magic, version, tokens.len() as i32, &tokens, width));
        let msg = err_text(TokenFile::open(&path));
        assert!(msg.contains(&format!("magic {magic}")) && msg.contains(&format!("version {version}")), "{msg}");
        assert!(msg.contains(name) && msg.contains("--data-format nanogpt"), "{msg}");
        // Forced raw, the header is read as tokens, as asked.
        let raw = TokenFile::open_with(&path, DataFormat::NanoGpt).unwrap();
        assert_eq!((raw.format(), raw.len()), (TokenFormat::NanoGptRaw, (1024 + tokens.len() * width) / 2));
    }
    // Not an llm.c header: a count that does not fit the length, or non-zero padding.
    let mut unfit = llmc_bytes(1234, 1, 5, &[1, 2, 3], 2);
    assert_eq!(TokenFile::open(&write(d, "unfit.bin", &unfit)).unwrap().format(), TokenFormat::NanoGptRaw);
    unfit[2 * 4..3 * 4].copy_from_slice(&3i32.to_le_bytes());
    unfit[100] = 1;
    assert_eq!(TokenFile::open(&write(d, "padded.bin", &unfit)).unwrap().format(), TokenFormat::NanoGptRaw);
    // All zeros is raw data (token 0 repeated), not an empty llm.c file.
    assert_eq!(TokenFile::open(&write(d, "zeros.bin", &[0; 1024])).unwrap().len(), 512);
}

#[test]
fn data_format_llmc_refuses_what_is_not_llmc() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.bin");
    write_nanogpt_raw(&path, &[1, 2, 3]).unwrap();
    let msg = err_text(TokenFile::open_with(&path, DataFormat::Llmc));
    assert!(msg.contains("--data-format llmc") && msg.contains("raw.bin"), "{msg}");
    let llmc = dir.path().join("llmc.bin");
    write_llmc(&llmc, &[1, 2, 3], 256).unwrap();
    assert_eq!(TokenFile::open_with(&llmc, DataFormat::Llmc).unwrap().format(), TokenFormat::LlmcGpt2);
    assert_eq!("nanogpt".parse::<DataFormat>(), Ok(DataFormat::NanoGpt));
    assert!("npy".parse::<DataFormat>().unwrap_err().contains("auto, llmc, nanogpt"));
}

#[test]
fn messages_name_formats_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let odd = write(d, "odd.bin", &[1, 2, 3]);
    let msg = err_text(TokenFile::open(&odd));
    assert!(msg.contains("(nanoGPT raw uint16)") && !msg.contains("NanoGptRaw"), "{msg}");
    let short = write(d, "short.bin", &llmc_bytes(LLMC_GPT2_MAGIC, 1, 4, &[1, 2], 2));
    let msg = err_text(TokenFile::open(&short));
    assert!(msg.contains("(llm.c GPT-2 kind") && !msg.contains("LlmcGpt2"), "{msg}");
    write_nanogpt_raw(&odd, &[1, 300]).unwrap();
    let msg = err_text(check_vocab(&TokenFile::open(&odd).unwrap(), 256));
    assert!(msg.contains("read as nanoGPT raw uint16"), "{msg}");
}

#[test]
fn windows_and_writers_check_their_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.bin");
    write_llmc(&path, &[1, 2, 3], 256).unwrap();
    let f = TokenFile::open(&path).unwrap();
    let mut out = [0u32; 4];
    assert!(err_text(f.copy_window(1, 3, &mut out)).contains("runs past the end"));
    assert!(err_text(f.copy_window(usize::MAX, 2, &mut out)).contains("runs past the end"));
    assert!(err_text(f.copy_window(0, 3, &mut out[..2])).contains("output buffer"));
    let msg = err_text(write_llmc(&path, &[1, 256], 256));
    assert!(msg.contains("token 1 is 256"), "{msg}");
    assert_eq!(read_all(&TokenFile::open(&path).unwrap()), [1, 2, 3]);
}

#[test]
fn check_vocab_reports_the_offending_id() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.bin");
    write_llmc(&path, &[5, 300, 2], 50257).unwrap();
    let f = TokenFile::open(&path).unwrap();
    check_vocab(&f, 301).unwrap();
    let msg = err_text(check_vocab(&f, 256));
    assert!(msg.contains("300") && msg.contains("256") && msg.contains("t.bin"), "{msg}");
}

// ---------------------------------------------------------------- samplers

/// A file whose token at position i is i % 50000, so targets are inputs + 1 within a window.
fn ramp_file(dir: &Path, n: usize) -> TokenFile {
    let path = dir.join(format!("ramp{n}.bin"));
    let tokens: Vec<u32> = (0..n as u32).map(|i| i % 50_000).collect();
    write_llmc(&path, &tokens, 50_000).unwrap();
    TokenFile::open(&path).unwrap()
}

#[test]
fn splitmix64_matches_the_reference_sequence() {
    // Vigna's splitmix64.c seeded with 0.
    let mut rng = SplitMix64::new(0);
    assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
    assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
    let mut rng = SplitMix64::new(7);
    for n in [1u64, 2, 3, 10, 1 << 40, u64::MAX] {
        for _ in 0..100 {
            assert!(rng.below(n) < n);
        }
    }
    let f = rng.next_f32();
    assert!((0.0..1.0).contains(&f));
}

#[test]
fn random_sampler_windows_are_consistent_and_seeded() {
    let dir = tempfile::tempdir().unwrap();
    let (b, t) = (4, 16);
    let mut s1 = RandomSampler::new(ramp_file(dir.path(), 1000), b, t, 42).unwrap();
    let mut s2 = RandomSampler::new(ramp_file(dir.path(), 1000), b, t, 42).unwrap();
    let mut s3 = RandomSampler::new(ramp_file(dir.path(), 1000), b, t, 43).unwrap();
    let batch = s1.next_batch().unwrap();
    assert_eq!((batch.inputs.len(), batch.targets.len()), (b * t, b * t));
    for row in 0..b {
        let inputs = &batch.inputs[row * t..(row + 1) * t];
        let targets = &batch.targets[row * t..(row + 1) * t];
        for i in 0..t {
            assert_eq!(targets[i], inputs[i] + 1);
            if i > 0 {
                assert_eq!(inputs[i], inputs[i - 1] + 1);
            }
        }
        assert!(targets[t - 1] < 1000);
    }
    assert_eq!(batch, s2.next_batch().unwrap());
    assert_ne!(batch, s3.next_batch().unwrap());
}

/// Data parallel: `W` ranks × batch `B` see, micro-batch by micro-batch, the rows one process
/// sees with batch `B` and `W` micro-batches; every rank's state equals the single process's
/// after the same rows, so a checkpoint resumes at any world size.
#[test]
fn sharded_samplers_split_the_global_stream_and_share_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let (b, t) = (2, 5);
    for world in [1, 2, 4] {
        let mut single = RandomSampler::new(ramp_file(dir.path(), 3000), b, t, 7).unwrap();
        let mut single_seq = SequentialSampler::new(ramp_file(dir.path(), 97), b, t).unwrap();
        let mut ranks: Vec<RandomSampler> = (0..world)
            .map(|rank| {
                RandomSampler::new(ramp_file(dir.path(), 3000), b, t, 7).unwrap().sharded(Shard { rank, world })
            })
            .collect();
        let mut ranks_seq: Vec<SequentialSampler> = (0..world)
            .map(|rank| SequentialSampler::new(ramp_file(dir.path(), 97), b, t).unwrap().sharded(Shard { rank, world }))
            .collect();
        for _micro_batch in 0..5 {
            for rank in 0..world {
                assert_eq!(ranks[rank].next_batch().unwrap(), single.next_batch().unwrap(), "W {world} rank {rank}");
                assert_eq!(ranks_seq[rank].next_batch().unwrap(), single_seq.next_batch().unwrap(), "W {world}");
            }
            for rank in 0..world {
                assert_eq!(ranks[rank].export_state(), single.export_state());
                assert_eq!(ranks_seq[rank].export_state(), single_seq.export_state());
            }
        }
    }
}

#[test]
fn random_sampler_reaches_both_ends_of_a_tiny_file() {
    let dir = tempfile::tempdir().unwrap();
    // 5 tokens, T = 3: start offsets 0 and 1 only.
    let mut s = RandomSampler::new(ramp_file(dir.path(), 5), 64, 3, 1).unwrap();
    let batch = s.next_batch().unwrap();
    let starts: std::collections::BTreeSet<u32> = batch.inputs.chunks(3).map(|r| r[0]).collect();
    assert_eq!(starts.into_iter().collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn random_sampler_resumes_exactly_from_exported_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = RandomSampler::new(ramp_file(dir.path(), 5000), 3, 8, 9).unwrap();
    for _ in 0..3 {
        a.next_batch().unwrap();
    }
    let state = a.export_state();
    let expected: Vec<_> = (0..5).map(|_| a.next_batch().unwrap()).collect();
    let mut b = RandomSampler::new(ramp_file(dir.path(), 5000), 3, 8, 12345).unwrap();
    b.import_state(&state).unwrap();
    let resumed: Vec<_> = (0..5).map(|_| b.next_batch().unwrap()).collect();
    assert_eq!(expected, resumed);
    assert!(b.import_state(&[1, 2]).is_err());
}

#[test]
fn sequential_sampler_walks_in_order_wraps_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    // 10 tokens, T = 3: windows start at 0, 3, 6, then wrap (9 + 4 > 10).
    let mut s = SequentialSampler::new(ramp_file(dir.path(), 10), 2, 3).unwrap();
    assert_eq!(s.batches_per_pass(), 1);
    let first = s.next_batch().unwrap();
    assert_eq!(first.inputs, [0, 1, 2, 3, 4, 5]);
    assert_eq!(first.targets, [1, 2, 3, 4, 5, 6]);
    let state = s.export_state();
    assert_eq!(state, [6]);
    let second = s.next_batch().unwrap();
    assert_eq!(second.inputs, [6, 7, 8, 0, 1, 2]);
    assert_eq!(second.targets, [7, 8, 9, 1, 2, 3]);
    let mut r = SequentialSampler::new(ramp_file(dir.path(), 10), 2, 3).unwrap();
    r.import_state(&state).unwrap();
    assert_eq!(r.next_batch().unwrap(), second);
    r.reset();
    assert_eq!(r.next_batch().unwrap(), first);
    assert!(err_text(r.import_state(&[10])).contains("past the end"));
}

#[test]
fn samplers_refuse_files_shorter_than_one_window() {
    let dir = tempfile::tempdir().unwrap();
    let msg = err_text(RandomSampler::new(ramp_file(dir.path(), 8), 1, 8, 0));
    assert!(msg.contains("8 tokens") && msg.contains("9 (T + 1)"), "{msg}");
    assert!(SequentialSampler::new(ramp_file(dir.path(), 8), 1, 8).is_err());
    assert!(SequentialSampler::new(ramp_file(dir.path(), 9), 1, 8).is_ok());
    assert!(RandomSampler::new(ramp_file(dir.path(), 9), 0, 8, 0).is_err());
}

// ---------------------------------------------------------------- prepare

#[test]
fn prepare_byte_level_splits_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let text = "To be, or not to be: that is the question. 日本\n".repeat(20);
    let input = write(dir.path(), "in.txt", text.as_bytes());
    let out = dir.path().join("out");
    let report = prepare(&[input], &Tokenizer::Byte, &out, 0.1).unwrap();
    let total = text.len();
    assert_eq!(report.val_tokens, (total as f64 * 0.1).round() as usize);
    assert_eq!(report.train_tokens + report.val_tokens, total);
    assert_eq!((report.tokenizer, report.vocab_size), ("byte", 256));
    assert_eq!(report.input_bytes, total as u64);
    let train = TokenFile::open(&report.train_path).unwrap();
    let val = TokenFile::open(&report.val_path).unwrap();
    assert_eq!(train.format(), TokenFormat::LlmcGpt2);
    let mut all = read_all(&train);
    all.extend(read_all(&val));
    assert_eq!(Tokenizer::Byte.decode(&all), text);
}

#[test]
fn prepare_gpt2_marks_each_document_with_end_of_text() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.txt", "First citizen: hello there.\n".repeat(10).as_bytes());
    let b = write(dir.path(), "b.txt", "Second document, café ☕.\n".repeat(10).as_bytes());
    let empty = write(dir.path(), "empty.txt", b"");
    let gpt2 = Tokenizer::from_name("gpt2").unwrap();
    let report = prepare(&[a.clone(), empty, b.clone()], &gpt2, dir.path(), 0.25).unwrap();
    let mut all = read_all(&TokenFile::open(&report.train_path).unwrap());
    all.extend(read_all(&TokenFile::open(&report.val_path).unwrap()));
    let eot = gpt2.eot_token().unwrap();
    assert_eq!(all.iter().filter(|&&t| t == eot).count(), 2);
    assert_eq!(all[0], eot);
    let expected =
        format!("<|endoftext|>{}<|endoftext|>{}", fs::read_to_string(a).unwrap(), fs::read_to_string(b).unwrap());
    assert_eq!(gpt2.decode(&all), expected);
}

#[test]
fn prepare_handles_inputs_above_the_progress_bar_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let line = "A line of text that repeats, with numbers 12345.\n";
    let text = line.repeat(PROGRESS_BAR_MIN_BYTES as usize / line.len() + 1000);
    assert!(text.len() as u64 > PROGRESS_BAR_MIN_BYTES);
    let input = write(dir.path(), "big.txt", text.as_bytes());
    let report = prepare(&[input], &Tokenizer::Byte, dir.path(), 0.001).unwrap();
    assert_eq!(report.train_tokens + report.val_tokens, text.len());
    let val = TokenFile::open(&report.val_path).unwrap();
    assert_eq!(Tokenizer::Byte.decode(&read_all(&val)), text[report.train_tokens..]);
}

#[test]
fn prepare_refuses_bad_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("out");
    let byte = Tokenizer::Byte;
    let ok = write(d, "ok.txt", b"some text that is long enough");
    assert!(err_text(prepare(&[], &byte, &out, 0.1)).contains("at least one input"));
    let empty = write(d, "empty.txt", b"");
    assert!(err_text(prepare(&[empty], &byte, &out, 0.1)).contains("empty"));
    let missing = d.join("missing.txt");
    assert!(err_text(prepare(&[missing], &byte, &out, 0.1)).contains("missing.txt"));
    let latin1 = write(d, "latin1.txt", &[b'c', b'a', b'f', 0xE9]);
    let msg = err_text(prepare(&[latin1], &byte, &out, 0.1));
    assert!(msg.contains("latin1.txt") && msg.contains("UTF-8"), "{msg}");
    for f in [0.0, 1.0, -0.5, f64::NAN] {
        assert!(err_text(prepare(std::slice::from_ref(&ok), &byte, &out, f)).contains("fraction"));
    }
    let tiny = write(d, "tiny.txt", b"abcde");
    let msg = err_text(prepare(&[tiny], &byte, &out, 0.1));
    assert!(msg.contains(&format!("at least {MIN_SPLIT_TOKENS}")), "{msg}");
    assert!(!out.exists());
}

// ---------------------------------------------------------------- digits

fn shipped_digits() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits.csv.gz")
}

#[test]
fn shipped_digits_load_as_1797_labelled_images() {
    let ds = load_digits_csv_gz(&shipped_digits()).unwrap();
    assert_eq!(ds.len(), 1797);
    assert_eq!((ds.channels(), ds.height(), ds.width()), (1, 8, 8));
    assert_eq!(ds.num_classes(), 10);
    let mut counts = [0usize; 10];
    for &l in ds.labels() {
        counts[l as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c > 150), "{counts:?}");
    // First row of the file.
    assert_eq!(&ds.pixels(0).unwrap()[..8], &[0, 0, 5, 13, 9, 1, 0, 0]);
    assert_eq!(ds.labels()[0], 0);
    let batch = ds.batch(&[0, 1], &Normalization::identity(1), None).unwrap();
    assert_eq!(batch.images.len(), 2 * 64);
    assert_eq!(batch.images[2], 5.0 / 16.0);
    assert!(batch.images.iter().all(|v| (0.0..=1.0).contains(v)));
}

#[test]
fn digits_split_keeps_the_last_fifth_for_evaluation() {
    let ds = load_digits_csv_gz(&shipped_digits()).unwrap();
    let (train, eval) = ds.split_tail(0.2).unwrap();
    assert_eq!((train.len(), eval.len()), (1438, 359));
    assert_eq!(eval.pixels(0), ds.pixels(1438));
    assert_eq!(eval.labels(), &ds.labels()[1438..]);
    assert_eq!(train.pixels(1437), ds.pixels(1437));
    assert_eq!(train.pixels(1438), None);
    assert!(ds.split_tail(0.0).is_err());
    assert!(ds.split_tail(0.0001).is_err());
}

#[test]
fn normalisation_centres_and_scales_each_channel() {
    let ds = load_digits_csv_gz(&shipped_digits()).unwrap();
    let norm = Normalization::from_dataset(&ds);
    let all: Vec<usize> = (0..ds.len()).collect();
    let batch = ds.batch(&all, &norm, None).unwrap();
    let n = batch.images.len() as f64;
    let mean = batch.images.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = batch.images.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
    assert!(mean.abs() < 1e-4, "mean {mean}");
    assert!((var - 1.0).abs() < 1e-3, "var {var}");
}

fn gz(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    let mut enc = flate2::write::GzEncoder::new(fs::File::create(&path).unwrap(), flate2::Compression::default());
    enc.write_all(text.as_bytes()).unwrap();
    enc.finish().unwrap();
    path
}

#[test]
fn corrupt_digits_files_name_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good_row = format!("{},3", vec!["1"; 64].join(","));
    let too_short = gz(d, "short.csv.gz", &format!("{good_row}\n1,2,3\n"));
    assert!(err_text(load_digits_csv_gz(&too_short)).contains("line 2: 3 values"));
    let pixel = gz(d, "pixel.csv.gz", &format!("{},3\n", vec!["17"; 64].join(",")));
    assert!(err_text(load_digits_csv_gz(&pixel)).contains("`17`"));
    let label = gz(d, "label.csv.gz", &format!("{},10\n", vec!["0"; 64].join(",")));
    assert!(err_text(load_digits_csv_gz(&label)).contains("field 65"));
    let plain = write(d, "plain.csv.gz", good_row.as_bytes());
    assert!(err_text(load_digits_csv_gz(&plain)).contains("plain.csv.gz"));
    let empty = gz(d, "empty.csv.gz", "\n");
    assert!(err_text(load_digits_csv_gz(&empty)).contains("no images"));
    let one = gz(d, "one.csv.gz", &format!("{good_row}\n"));
    assert_eq!(load_digits_csv_gz(&one).unwrap().labels(), &[3]);
}

// ---------------------------------------------------------------- CIFAR

/// Pixel `k` of global image `r` in the generated files.
fn pixel(r: usize, k: usize) -> u8 {
    ((r * 7 + k * 3) % 256) as u8
}

/// Writes `rows` CIFAR rows starting at global image `first`, with `label_bytes` labels.
fn cifar_file(path: &Path, first: usize, rows: usize, labels: impl Fn(usize) -> Vec<u8>) {
    let mut bytes = Vec::new();
    for r in first..first + rows {
        bytes.extend(labels(r));
        bytes.extend((0..3072).map(|k| pixel(r, k)));
    }
    fs::write(path, bytes).unwrap();
}

#[test]
fn cifar10_directory_reads_batches_in_numeric_order() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let label10 = |r: usize| vec![(r % 10) as u8];
    cifar_file(&d.join("data_batch_1.bin"), 0, 3, label10);
    cifar_file(&d.join("data_batch_2.bin"), 3, 2, label10);
    cifar_file(&d.join("data_batch_10.bin"), 5, 1, label10);
    cifar_file(&d.join("test_batch.bin"), 100, 2, label10);
    let train = load_cifar10_dir(d, Split::Train).unwrap();
    assert_eq!(train.len(), 6);
    assert_eq!((train.channels(), train.height(), train.width()), (3, 32, 32));
    assert_eq!(train.labels(), &[0, 1, 2, 3, 4, 5]);
    for r in 0..6 {
        let p = train.pixels(r).unwrap();
        assert_eq!(p.len(), 3072);
        assert!(p.iter().enumerate().all(|(k, &v)| v == pixel(r, k)), "image {r}");
    }
    let test = load_cifar10_dir(d, Split::Test).unwrap();
    assert_eq!(test.labels(), &[0, 1]);
    assert_eq!(test.pixels(1).unwrap()[5], pixel(101, 5));
    let (head, tail) = train.split_tail(0.5).unwrap();
    assert_eq!(head.len(), 3);
    assert_eq!(tail.pixels(0), train.pixels(3));
    let batch = tail.batch(&[2, 0], &Normalization::identity(3), None).unwrap();
    assert_eq!(batch.labels, [5, 3]);
    assert_eq!(batch.images[1024], f32::from(pixel(5, 1024)) / 255.0);
}

#[test]
fn cifar100_reads_coarse_or_fine_labels() {
    let dir = tempfile::tempdir().unwrap();
    let labels = |r: usize| vec![(r % 20) as u8, (r * 13 % 100) as u8];
    cifar_file(&dir.path().join("train.bin"), 0, 4, labels);
    let fine = load_cifar100_dir(dir.path(), Split::Train, Cifar100Labels::Fine).unwrap();
    assert_eq!(fine.num_classes(), 100);
    assert_eq!(fine.labels(), &[0, 13, 26, 39]);
    assert_eq!(fine.pixels(3).unwrap()[3071], pixel(3, 3071));
    let coarse = load_cifar100(&dir.path().join("train.bin"), Cifar100Labels::Coarse).unwrap();
    assert_eq!((coarse.num_classes(), coarse.labels()), (20, &[0u32, 1, 2, 3][..]));
    assert!(load_cifar100_dir(dir.path(), Split::Test, Cifar100Labels::Fine).is_err());
}

#[test]
fn corrupt_cifar_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let truncated = d.join("truncated.bin");
    cifar_file(&truncated, 0, 2, |_| vec![1]);
    let bytes = fs::read(&truncated).unwrap();
    fs::write(&truncated, &bytes[..bytes.len() - 1]).unwrap();
    let msg = err_text(load_cifar10(std::slice::from_ref(&truncated)));
    assert!(msg.contains("truncated.bin") && msg.contains("3073-byte rows"), "{msg}");
    // A CIFAR-10 file read as CIFAR-100 has the wrong row length.
    let ten = d.join("ten.bin");
    cifar_file(&ten, 0, 2, |_| vec![1]);
    assert!(err_text(load_cifar100(&ten, Cifar100Labels::Fine)).contains("3074-byte rows"));
    let label = d.join("label.bin");
    cifar_file(&label, 0, 1, |_| vec![10]);
    assert!(err_text(load_cifar10(&[label])).contains("label 10"));
    let empty = write(d, "empty.bin", b"");
    assert!(err_text(load_cifar10(&[empty])).contains("empty"));
    assert!(err_text(load_cifar10(&[d.join("nope.bin")])).contains("nope.bin"));
    let msg = err_text(load_cifar10_dir(d, Split::Train));
    assert!(msg.contains("data_batch_"), "{msg}");
}

#[test]
fn augmentation_is_a_shifted_possibly_flipped_copy_and_seeded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data_batch_1.bin");
    cifar_file(&path, 0, 4, |r| vec![r as u8]);
    let ds = load_cifar10(&[path]).unwrap();
    let id = Normalization::identity(3);
    let plain = ds.batch(&[0, 1, 2, 3], &id, None).unwrap();
    let aug = Augmentation::CIFAR;
    let mut rng = SplitMix64::new(5);
    let augmented = ds.batch(&[0, 1, 2, 3], &id, Some((&aug, &mut rng))).unwrap();
    let mut rng = SplitMix64::new(5);
    let again = ds.batch(&[0, 1, 2, 3], &id, Some((&aug, &mut rng))).unwrap();
    assert_eq!(augmented, again);
    assert_eq!(augmented.labels, plain.labels);
    let (h, w) = (32isize, 32isize);
    for img in 0..4 {
        let src = &plain.images[img * 3072..(img + 1) * 3072];
        let out = &augmented.images[img * 3072..(img + 1) * 3072];
        let mut found = false;
        for dy in -4..=4isize {
            for dx in -4..=4isize {
                for flip in [false, true] {
                    let matches = (0..3).all(|c| {
                        (0..h).all(|y| {
                            (0..w).all(|x| {
                                let xs = if flip { w - 1 - x } else { x } + dx;
                                let sy = y + dy;
                                let expect = if (0..h).contains(&sy) && (0..w).contains(&xs) {
                                    src[(c * 1024 + sy * 32 + xs) as usize]
                                } else {
                                    0.0
                                };
                                out[(c * 1024 + y * 32 + x) as usize] == expect
                            })
                        })
                    });
                    found |= matches;
                }
            }
        }
        assert!(found, "image {img} is not a padded crop / flip of its source");
    }
    let none = Augmentation { pad: 0, flip: false };
    let mut rng = SplitMix64::new(1);
    let unchanged = ds.batch(&[0, 1, 2, 3], &id, Some((&none, &mut rng))).unwrap();
    assert_eq!(unchanged, plain);
    assert!(ds.batch(&[4], &id, None).is_err());
    assert!(ds.batch(&[0], &Normalization::identity(1), None).is_err());
    let zero_std = Normalization { mean: vec![0.0; 3], std: vec![1.0, 0.0, 1.0] };
    assert!(err_text(ds.batch(&[0], &zero_std, None)).contains("positive"));
}

#[test]
fn image_loader_shuffles_each_epoch_and_resumes_exactly() {
    let ds = load_digits_csv_gz(&shipped_digits()).unwrap();
    let (_, small) = ds.split_tail(0.01).unwrap();
    assert_eq!(small.len(), 18);
    let norm = Normalization::from_dataset(&small);
    let aug = Some(Augmentation { pad: 1, flip: false });
    let mut a = ImageLoader::new(small.clone(), 6, norm.clone(), aug, 3).unwrap();
    let mut epoch_labels = Vec::new();
    for _ in 0..3 {
        epoch_labels.extend(a.next_batch().unwrap().labels);
    }
    epoch_labels.sort();
    let mut expected = small.labels().to_vec();
    expected.sort();
    assert_eq!(epoch_labels, expected, "one epoch visits every image once");
    a.next_batch().unwrap();
    assert_eq!(a.epoch(), 1);
    let state = a.export_state();
    let expect: Vec<_> = (0..4).map(|_| a.next_batch().unwrap()).collect();
    let mut b = ImageLoader::new(small.clone(), 6, norm.clone(), aug, 3).unwrap();
    b.import_state(&state).unwrap();
    let resumed: Vec<_> = (0..4).map(|_| b.next_batch().unwrap()).collect();
    assert_eq!(expect, resumed);
    let mut c = ImageLoader::new(small.clone(), 6, norm.clone(), aug, 4).unwrap();
    let mut first = ImageLoader::new(small, 6, norm, aug, 3).unwrap();
    assert_ne!(c.next_batch().unwrap(), first.next_batch().unwrap());
    assert!(b.import_state(&[0, 99, 0]).is_err());
}
