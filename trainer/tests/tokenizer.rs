//! Tokenizers: byte-level and GPT-2 round trips (ASCII, accents, CJK, emoji), known GPT-2 ids,
//! lossy decoding, name handling, and chunked encoding equal to whole-text encoding.

use proptest::prelude::*;
use trainer::prepare::encode_in_chunks;
use trainer::tokenizer::{Tokenizer, GPT2_EOT_TOKEN, GPT2_VOCAB_SIZE};

const UNICODE: &str = "Héllo, wörld! 日本語のテキスト 🚀🦀 — «quotes» \u{0301}e\n\tnew line  ";

fn shakespeare() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/tinyshakespeare.txt");
    std::fs::read_to_string(path).expect("data/tinyshakespeare.txt ships with the repository")
}

fn gpt2() -> Tokenizer {
    Tokenizer::from_name("gpt2").unwrap()
}

#[test]
fn names_and_vocab_sizes() {
    let byte = Tokenizer::from_name("byte").unwrap();
    assert_eq!((byte.name(), byte.vocab_size(), byte.eot_token()), ("byte", 256, None));
    let g = gpt2();
    assert_eq!(g.name(), "gpt2");
    assert_eq!(g.vocab_size(), GPT2_VOCAB_SIZE);
    assert_eq!(g.eot_token(), Some(GPT2_EOT_TOKEN));
    assert_eq!(GPT2_EOT_TOKEN, 50256);
    let msg = format!("{:#}", Tokenizer::from_name("sentencepiece").unwrap_err());
    assert!(msg.contains("sentencepiece") && msg.contains("byte") && msg.contains("gpt2"), "{msg}");
}

#[test]
fn byte_tokenizer_round_trips_utf8_bytes() {
    let t = Tokenizer::Byte;
    let ids = t.encode(UNICODE);
    assert_eq!(ids.len(), UNICODE.len());
    assert!(ids.iter().all(|&i| i < 256));
    assert_eq!(ids[..2], [u32::from(b'H'), 0xC3]);
    assert_eq!(t.decode(&ids), UNICODE);
}

#[test]
fn byte_decoding_is_lossy_on_invalid_utf8_and_out_of_range_ids() {
    let t = Tokenizer::Byte;
    let crab = t.encode("🦀");
    assert_eq!(crab.len(), 4);
    assert_eq!(t.decode(&crab[..2]), "\u{FFFD}");
    assert_eq!(t.decode(&[u32::from(b'a'), 300, u32::from(b'b')]), "a\u{FFFD}b");
}

#[test]
fn gpt2_matches_known_ids() {
    let g = gpt2();
    // tiktoken.get_encoding("gpt2").encode("Hello world") == [15496, 995]
    assert_eq!(g.encode("Hello world"), vec![15496, 995]);
    // " the" is 262, "\n" is 198 in GPT-2's vocabulary.
    assert_eq!(g.encode(" the\n"), vec![262, 198]);
    assert_eq!(g.decode(&[15496, 995]), "Hello world");
}

#[test]
fn gpt2_round_trips_unicode_and_stays_in_vocab() {
    let g = gpt2();
    let ids = g.encode(UNICODE);
    assert!(ids.iter().all(|&i| (i as usize) < GPT2_VOCAB_SIZE));
    assert_eq!(g.decode(&ids), UNICODE);
}

#[test]
fn gpt2_encodes_the_special_token_text_as_ordinary_text() {
    let g = gpt2();
    let ids = g.encode("a<|endoftext|>b");
    assert!(!ids.contains(&GPT2_EOT_TOKEN));
    assert_eq!(g.decode(&ids), "a<|endoftext|>b");
    assert_eq!(g.decode(&[GPT2_EOT_TOKEN]), "<|endoftext|>");
}

#[test]
fn gpt2_decoding_is_lossy_on_unknown_ids_and_split_characters() {
    let g = gpt2();
    let hi = g.encode("hi");
    let mut ids = hi.clone();
    ids.push(60_000);
    ids.extend(&hi);
    assert_eq!(g.decode(&ids), "hi\u{FFFD}hi");
    let crab = g.encode("🦀");
    assert!(crab.len() > 1, "the crab is several byte-level tokens: {crab:?}");
    assert!(g.decode(&crab[..1]).contains('\u{FFFD}'));
}

#[test]
fn gpt2_survives_pathological_whitespace() {
    let g = gpt2();
    let text = format!("x{}y{}", " ".repeat(200_000), "\n".repeat(100_000));
    assert_eq!(g.decode(&g.encode(&text)), text);
}

#[test]
fn chunked_encoding_equals_whole_text_encoding() {
    let text = shakespeare();
    for t in [Tokenizer::Byte, gpt2()] {
        let whole = t.encode(&text);
        let mut seen = 0;
        let chunked = encode_in_chunks(&t, &text, 4096, |n| seen += n);
        assert_eq!(seen, text.len());
        assert_eq!(chunked, whole, "{} chunked encoding differs", t.name());
    }
    // Whitespace and newline runs around the cut points.
    let tricky = "a \n\nB\n C\nD \nE\n\n\nF\n  g\nh";
    let g = gpt2();
    for chunk in 1..tricky.len() {
        assert_eq!(encode_in_chunks(&g, tricky, chunk, |_| {}), g.encode(tricky));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_string_round_trips(s in "\\PC{0,40}") {
        prop_assert_eq!(Tokenizer::Byte.decode(&Tokenizer::Byte.encode(&s)), s.clone());
        let g = gpt2();
        prop_assert_eq!(g.decode(&g.encode(&s)), s);
    }
}
