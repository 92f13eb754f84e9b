//! One NVRTC compilation: source and options in, a CUBIN or PTX image out, or the compile
//! log on failure.
//!
//! cudarc's safe wrapper returns PTX only; a CUBIN for the device's exact architecture
//! (`--gpu-architecture=sm_XY`) is preferred, because a driver JIT-compiles PTX only when it
//! is at least as new as the NVRTC that wrote it, while a CUBIN loads on any driver of the
//! same CUDA major version.

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result, sys};

/// A compiled translation unit.
#[derive(Clone, Debug)]
pub enum KernelImage {
    /// Machine code for one architecture (`sm_XY`).
    Cubin(Vec<u8>),
    /// PTX text for a virtual architecture (`compute_XY`), finished by the driver.
    Ptx(String),
}

impl KernelImage {
    /// Bytes of the image.
    pub fn len(&self) -> usize {
        match self {
            KernelImage::Cubin(bytes) => bytes.len(),
            KernelImage::Ptx(text) => text.len(),
        }
    }

    /// Whether the image is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    Cubin,
    Ptx,
}

/// Deletes the program however the compilation ends.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed once, here.
        // A failure to free it leaks a little host memory; there is nothing to report it to.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `source` (named `name` in messages) with `options`; the error is NVRTC's
/// status and compile log.
pub(crate) fn compile(source: &str, name: &str, options: &[String], output: Output) -> Result<KernelImage, String> {
    let source = CString::new(source).map_err(|_| "the source contains a NUL byte".to_string())?;
    let name = CString::new(name).map_err(|_| "the name contains a NUL byte".to_string())?;
    let program =
        Program(result::create_program(&source, Some(name.as_c_str())).map_err(|e| format!("create: {e:?}"))?);
    // SAFETY: `program` is live for the whole block; the buffers are sized by NVRTC's own
    // size queries before NVRTC writes into them.
    unsafe {
        if let Err(status) = result::compile_program(program.0, options) {
            let log = result::get_program_log(program.0).map(|l| text(&l)).unwrap_or_default();
            return Err(format!("{status:?} with options {options:?}\n{log}"));
        }
        match output {
            Output::Ptx => {
                let ptx = result::get_ptx(program.0).map_err(|e| format!("reading the PTX: {e:?}"))?;
                Ok(KernelImage::Ptx(text(&ptx)))
            }
            Output::Cubin => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(program.0, &mut size).result().map_err(|e| format!("CUBIN size: {e:?}"))?;
                let mut bytes = vec![0u8; size];
                sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| format!("reading the CUBIN: {e:?}"))?;
                Ok(KernelImage::Cubin(bytes))
            }
        }
    }
}

/// NVRTC's version as `(major, minor)`, for messages.
pub fn version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().ok().map(|_| (major, minor))
}
