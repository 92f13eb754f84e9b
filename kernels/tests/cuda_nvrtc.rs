//! Every kernel family compiles with NVRTC. This needs only `libnvrtc` (no driver, no GPU),
//! so it also runs on build machines that have the NVRTC library but no device; without
//! the library it prints `skipping: NVRTC not available` and returns.
#![cfg(feature = "cuda")]

use kernels::cuda::module::{compile_family, KernelFamily};
use kernels::cuda::nvrtc::KernelImage;

/// Whether libnvrtc can be loaded (cudarc's loader would panic otherwise).
fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

#[test]
fn every_family_compiles_for_ampere_and_hopper() {
    if !nvrtc_present() {
        assert!(
            std::env::var_os("TRANSPONDER_REQUIRE_NVRTC").is_none(),
            "TRANSPONDER_REQUIRE_NVRTC is set: no libnvrtc"
        );
        return println!("skipping: NVRTC not available");
    }
    println!("NVRTC {:?}", kernels::cuda::nvrtc::version());
    for capability in [(8, 0), (9, 0)] {
        for family in KernelFamily::ALL {
            let image = compile_family(family, capability).unwrap_or_else(|e| panic!("{e}"));
            let bytes: &[u8] = match image.as_ref() {
                KernelImage::Cubin(bytes) => bytes,
                KernelImage::Ptx(text) => {
                    assert!(text.contains(".entry"), "{} produced no kernel for {capability:?}", family.file());
                    text.as_bytes()
                }
            };
            assert!(!bytes.is_empty(), "{} produced an empty image", family.file());
            // TRANSPONDER_DUMP_KERNELS=dir writes the images, e.g. for `cuobjdump` or `nvdisasm`.
            if let Some(dir) = std::env::var_os("TRANSPONDER_DUMP_KERNELS") {
                let (major, minor) = capability;
                let name = format!("{}.sm{major}{minor}.bin", family.file().trim_end_matches(".cu"));
                std::fs::write(std::path::Path::new(&dir).join(name), bytes).expect("writing the image");
            }
        }
    }
}
