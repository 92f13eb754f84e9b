//! Finding and loading libnccl, and the NCCL functions we call.
//!
//! cudarc's own loader (`cudarc::nccl::sys::culib`, cudarc 0.19.10 `src/nccl/sys/mod.rs`
//! l.1375-1387) is a private `OnceLock` that tries only the names of
//! `cudarc::get_lib_name_candidates("nccl")` (`src/lib.rs` l.204-243: `libnccl.so`,
//! `libnccl.so.13`, `.12`, …, `.1`), never `libnccl.so.2` (NCCL's soname and the only file
//! the PyPI wheels `nvidia-nccl-cu12/13` ship), takes no path, and panics when nothing
//! loads. There is no public `Lib` type to hand a path to. So we load the library with
//! `libloading` (the crate cudarc itself loads with, same version, no new dependency in the
//! tree) from the places below, resolve the ten functions we call, and use cudarc's types
//! (`ncclComm_t`, `ncclUniqueId`, `ncclDataType_t`, `ncclRedOp_t`, `cudaStream_t`) for their
//! signatures. Results are read as plain `c_int`, not as cudarc's `ncclResult_t` enum, so a
//! code this binding does not know cannot be undefined behaviour.
//!
//! Where we look, in order (the first that loads wins):
//! 1. `TRANSPONDER_NCCL_LIB`, a file path: when set, the only candidate;
//! 2. `libnccl.so.2`, then `libnccl.so`, by name (the dynamic loader's search:
//!    `LD_LIBRARY_PATH`, the ldconfig cache, system directories);
//! 3. `nvidia/nccl/lib/libnccl.so.2` under each entry of `PYTHONPATH`;
//! 4. the same under each site-packages directory of `python3` (asked only when 1-3 fail).

use std::ffi::{c_char, c_int, c_void, CStr, OsString};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use libloading::Library;

use crate::cuda::error::{CudaError, Result};

/// The environment variable naming libnccl's path.
pub(crate) const ENV_PATH: &str = "TRANSPONDER_NCCL_LIB";
/// The library inside a `nvidia-nccl-cu12/13` wheel, relative to site-packages.
const WHEEL_PATH: &str = "nvidia/nccl/lib/libnccl.so.2";
/// The oldest NCCL with every function we call (`ncclCommGetAsyncError` and `ncclCommAbort`
/// came in 2.4).
const MIN_VERSION: (u32, u32, u32) = (2, 4, 0);
/// `ncclGetLastError` came in 2.13: called only on a runtime at least this new.
const LAST_ERROR_VERSION: (u32, u32, u32) = (2, 13, 0);

/// One place to look for libnccl.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Candidate {
    /// A file name the dynamic loader searches for.
    Name(&'static str),
    /// A path, and where it came from (for the error message).
    Path(PathBuf, &'static str),
}

impl Candidate {
    fn describe(&self) -> String {
        match self {
            Candidate::Name(name) => format!("{name} (the dynamic loader's search: LD_LIBRARY_PATH, ldconfig)"),
            Candidate::Path(path, from) => format!("{} (from {from})", path.display()),
        }
    }
}

/// Steps 1-3 of the search (see the module documentation), from the environment `var`.
pub(crate) fn first_candidates(var: impl Fn(&str) -> Option<OsString>) -> Vec<Candidate> {
    if let Some(path) = var(ENV_PATH).filter(|p| !p.is_empty()) {
        return vec![Candidate::Path(PathBuf::from(path), ENV_PATH)];
    }
    let mut candidates = vec![Candidate::Name("libnccl.so.2"), Candidate::Name("libnccl.so")];
    if let Some(paths) = var("PYTHONPATH") {
        candidates.extend(std::env::split_paths(&paths).map(|dir| Candidate::Path(dir.join(WHEEL_PATH), "PYTHONPATH")));
    }
    candidates
}

/// Step 4: the wheel's library under each of `site_dirs`.
pub(crate) fn site_candidates(site_dirs: Vec<PathBuf>) -> Vec<Candidate> {
    site_dirs.into_iter().map(|dir| Candidate::Path(dir.join(WHEEL_PATH), "python3's site-packages")).collect()
}

/// The site-packages directories of `python3` (none when there is no `python3`).
fn python_site_dirs() -> Vec<PathBuf> {
    let script = "import site\nfor d in site.getsitepackages() + [site.getusersitepackages()]: print(d)";
    match std::process::Command::new("python3").args(["-c", script]).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).collect(),
        _ => Vec::new(),
    }
}

/// The error when no candidate loads: every place tried, why it failed, and the fix.
pub(crate) fn not_found(attempts: &[(String, String)]) -> String {
    let mut message = String::from("cannot load NCCL (libnccl); tried:");
    for (place, why) in attempts {
        message.push_str(&format!("\n  {place}: {why}"));
    }
    message.push_str(&format!(
        "\nInstall it with `pip install nvidia-nccl-cu13` (found through PYTHONPATH or python3's site-packages), \
         or set {ENV_PATH} to the path of libnccl.so.2"
    ));
    message
}

/// `(major, minor, patch)` of an `ncclGetVersion` code (2.9 and later: major·10000 +
/// minor·100 + patch; before: major·1000 + minor·100 + patch).
pub(crate) fn decode_version(code: c_int) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10_000 {
        (code / 10_000, code % 10_000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    }
}

type Status = c_int;

/// The functions we call, resolved once.
struct Functions {
    get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Status,
    comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> Status,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> Status,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> Status,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> Status,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> Status,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> Status,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> Status,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Status,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    get_last_error: Option<unsafe extern "C" fn(ncclComm_t) -> *const c_char>,
}

/// A loaded libnccl.
pub(crate) struct Nccl {
    /// Keeps the functions' code mapped (the value lives in a static).
    _library: Library,
    /// Where it was loaded from.
    pub(crate) origin: String,
    /// `(major, minor, patch)` of the runtime.
    pub(crate) version: (u32, u32, u32),
    f: Functions,
}

/// Resolves `name` in `library` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the function's C signature.
unsafe fn symbol<F: Copy>(library: &Library, name: &str) -> std::result::Result<F, String> {
    library.get::<F>(name.as_bytes()).map(|s| *s).map_err(|e| format!("missing symbol {name}: {e}"))
}

impl Nccl {
    /// Loads the first candidate that opens and has every function we need.
    fn find(
        var: impl Fn(&str) -> Option<OsString>,
        site_dirs: impl FnOnce() -> Vec<PathBuf>,
    ) -> std::result::Result<Nccl, String> {
        let mut attempts = Vec::new();
        let explicit = var(ENV_PATH).is_some_and(|p| !p.is_empty());
        let first = first_candidates(&var);
        if let Some(nccl) = Nccl::try_each(&first, &mut attempts) {
            return Ok(nccl);
        }
        if !explicit {
            if let Some(nccl) = Nccl::try_each(&site_candidates(site_dirs()), &mut attempts) {
                return Ok(nccl);
            }
        }
        Err(not_found(&attempts))
    }

    fn try_each(candidates: &[Candidate], attempts: &mut Vec<(String, String)>) -> Option<Nccl> {
        for candidate in candidates {
            match Nccl::open(candidate) {
                Ok(nccl) => return Some(nccl),
                Err(why) => attempts.push((candidate.describe(), why)),
            }
        }
        None
    }

    fn open(candidate: &Candidate) -> std::result::Result<Nccl, String> {
        let target = match candidate {
            Candidate::Name(name) => name.to_string(),
            Candidate::Path(path, _) if !path.exists() => return Err("no such file".to_string()),
            Candidate::Path(path, _) => path.to_str().ok_or("not a UTF-8 path")?.to_string(),
        };
        // SAFETY: loading libnccl runs its initialisers, which only set up NCCL's own state.
        let library = unsafe { Library::new(target) }.map_err(|e| e.to_string())?;
        // SAFETY: each type below is the C signature of the function of that name in nccl.h
        // (the same signatures as cudarc's bindings, `src/nccl/sys/mod.rs`).
        let f = unsafe {
            Functions {
                get_version: symbol(&library, "ncclGetVersion")?,
                get_unique_id: symbol(&library, "ncclGetUniqueId")?,
                comm_init_rank: symbol(&library, "ncclCommInitRank")?,
                all_reduce: symbol(&library, "ncclAllReduce")?,
                broadcast: symbol(&library, "ncclBroadcast")?,
                reduce_scatter: symbol(&library, "ncclReduceScatter")?,
                all_gather: symbol(&library, "ncclAllGather")?,
                comm_get_async_error: symbol(&library, "ncclCommGetAsyncError")?,
                comm_abort: symbol(&library, "ncclCommAbort")?,
                comm_destroy: symbol(&library, "ncclCommDestroy")?,
                get_error_string: symbol(&library, "ncclGetErrorString")?,
                get_last_error: symbol(&library, "ncclGetLastError").ok(),
            }
        };
        let mut code = 0;
        // SAFETY: writes one int.
        let status = unsafe { (f.get_version)(&mut code) };
        if status != 0 {
            return Err(format!("ncclGetVersion failed with status {status}"));
        }
        let version = decode_version(code);
        if version < MIN_VERSION {
            return Err(format!("NCCL {}.{}.{} is older than 2.4, which we need", version.0, version.1, version.2));
        }
        let origin = match candidate {
            Candidate::Name(name) => name.to_string(),
            Candidate::Path(path, _) => path.display().to_string(),
        };
        Ok(Nccl { _library: library, origin, version, f })
    }

    /// `NCCL 2.29.7 (/path/libnccl.so.2)`.
    pub(crate) fn describe(&self) -> String {
        let (major, minor, patch) = self.version;
        format!("NCCL {major}.{minor}.{patch} ({})", self.origin)
    }

    /// Ok for `ncclSuccess`; otherwise a [`CudaError::Nccl`] for `call` with NCCL's message
    /// (and, on NCCL ≥ 2.13, its last error on `comm`).
    pub(crate) fn check(&self, call: impl Into<String>, status: Status, comm: Option<ncclComm_t>) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let mut message = unsafe { c_string((self.f.get_error_string)(status)) };
        message = format!("{message} (status {status})");
        if let (Some(last_error), Some(comm), true) = (self.f.get_last_error, comm, self.version >= LAST_ERROR_VERSION)
        {
            // SAFETY: `comm` is a live communicator; the string is NCCL's (thread-local) buffer.
            let detail = unsafe { c_string(last_error(comm)) };
            if !detail.is_empty() {
                message = format!("{message}: {detail}");
            }
        }
        Err(CudaError::Nccl { call: call.into(), message })
    }

    /// `ncclGetUniqueId`.
    pub(crate) fn unique_id(&self) -> Result<[u8; 128]> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        self.check("ncclGetUniqueId", unsafe { (self.f.get_unique_id)(&mut id) }, None)?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// `ncclCommInitRank` (the device's context must be current on this thread).
    pub(crate) fn init_rank(&self, id: [u8; 128], rank: c_int, world_size: c_int) -> Result<ncclComm_t> {
        let id = ncclUniqueId { internal: id.map(|b| b as c_char) };
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes the communicator handle; the id is passed by value.
        let status = unsafe { (self.f.comm_init_rank)(&mut comm, world_size, id, rank) };
        self.check(format!("ncclCommInitRank (rank {rank} of {world_size})"), status, None)?;
        Ok(comm)
    }

    /// `ncclAllReduce`.
    ///
    /// # Safety
    /// `send` and `recv` are device ranges of `count` f32 each, ordered by `stream`; `comm` is live.
    pub(crate) unsafe fn all_reduce(
        &self,
        (send, recv, count): (u64, u64, usize),
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> Status {
        (self.f.all_reduce)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            ncclDataType_t::ncclFloat32,
            op,
            comm,
            stream,
        )
    }

    /// `ncclBroadcast`.
    ///
    /// # Safety
    /// As [`Nccl::all_reduce`].
    pub(crate) unsafe fn broadcast(
        &self,
        (send, recv, count): (u64, u64, usize),
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> Status {
        (self.f.broadcast)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            ncclDataType_t::ncclFloat32,
            root,
            comm,
            stream,
        )
    }

    /// `ncclReduceScatter` (`count` = elements per rank, `recv`'s length).
    ///
    /// # Safety
    /// `send` holds `count × ranks` f32, `recv` `count`; otherwise as [`Nccl::all_reduce`].
    pub(crate) unsafe fn reduce_scatter(
        &self,
        (send, recv, count): (u64, u64, usize),
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> Status {
        let f = self.f.reduce_scatter;
        f(send as *const c_void, recv as *mut c_void, count, ncclDataType_t::ncclFloat32, op, comm, stream)
    }

    /// `ncclAllGather` (`count` = elements per rank, `send`'s length).
    ///
    /// # Safety
    /// `send` holds `count` f32, `recv` `count × ranks`; otherwise as [`Nccl::all_reduce`].
    pub(crate) unsafe fn all_gather(
        &self,
        (send, recv, count): (u64, u64, usize),
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> Status {
        (self.f.all_gather)(
            send as *const c_void,
            recv as *mut c_void,
            count,
            ncclDataType_t::ncclFloat32,
            comm,
            stream,
        )
    }

    /// `ncclCommGetAsyncError`: the call's status and the communicator's asynchronous error.
    ///
    /// # Safety
    /// `comm` is live.
    pub(crate) unsafe fn async_error(&self, comm: ncclComm_t) -> (Status, Status) {
        let mut error = 0;
        let status = (self.f.comm_get_async_error)(comm, &mut error);
        (status, error)
    }

    /// `ncclCommAbort`.
    ///
    /// # Safety
    /// `comm` is live and not used again.
    pub(crate) unsafe fn abort(&self, comm: ncclComm_t) -> Status {
        (self.f.comm_abort)(comm)
    }

    /// `ncclCommDestroy`.
    ///
    /// # Safety
    /// `comm` is live and not used again.
    pub(crate) unsafe fn destroy(&self, comm: ncclComm_t) -> Status {
        (self.f.comm_destroy)(comm)
    }
}

/// A C string NCCL returned (empty for null).
///
/// # Safety
/// `ptr` is null or a NUL-terminated string.
unsafe fn c_string(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    CStr::from_ptr(ptr).to_string_lossy().into_owned()
}

/// The process's libnccl, loaded on first use; [`CudaError::Unavailable`] with every place
/// searched when none loads.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| Nccl::find(|name| std::env::var_os(name), python_site_dirs))
        .as_ref()
        .map_err(|why| CudaError::Unavailable(why.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v))
    }

    #[test]
    fn the_search_list_follows_the_documented_order() {
        let list = first_candidates(env(&[("PYTHONPATH", "/a:/b/c")]));
        assert_eq!(
            list,
            vec![
                Candidate::Name("libnccl.so.2"),
                Candidate::Name("libnccl.so"),
                Candidate::Path("/a/nvidia/nccl/lib/libnccl.so.2".into(), "PYTHONPATH"),
                Candidate::Path("/b/c/nvidia/nccl/lib/libnccl.so.2".into(), "PYTHONPATH"),
            ]
        );
        let only = first_candidates(env(&[(ENV_PATH, "/opt/nccl/libnccl.so.2"), ("PYTHONPATH", "/a")]));
        assert_eq!(
            only,
            vec![Candidate::Path("/opt/nccl/libnccl.so.2".into(), ENV_PATH)],
            "an explicit path is the only one"
        );
        assert_eq!(first_candidates(env(&[])).len(), 2);
        let sites = site_candidates(vec!["/usr/lib/python3/dist-packages".into()]);
        assert_eq!(
            sites,
            vec![Candidate::Path(
                "/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2".into(),
                "python3's site-packages"
            )]
        );
    }

    #[test]
    fn a_failed_search_lists_every_place_and_the_fix() {
        let vars = [(ENV_PATH, "/nonexistent/libnccl.so.2")];
        let error =
            Nccl::find(env(&vars), || unreachable!("an explicit path is not widened")).err().expect("nothing loads");
        assert!(error.contains("/nonexistent/libnccl.so.2 (from TRANSPONDER_NCCL_LIB): no such file"), "{error}");
        assert!(error.contains("pip install nvidia-nccl-cu13") && error.contains(ENV_PATH), "{error}");

        let attempts = vec![("libnccl.so.2 (the dynamic loader's search)".to_string(), "not found".to_string())];
        let message = not_found(&attempts);
        assert!(message.starts_with("cannot load NCCL (libnccl); tried:\n  libnccl.so.2"), "{message}");
    }

    #[test]
    fn versions_decode_in_both_formats() {
        assert_eq!(decode_version(22907), (2, 29, 7));
        assert_eq!(decode_version(21003), (2, 10, 3));
        assert_eq!(decode_version(2408), (2, 4, 8));
        assert!(decode_version(2306) < MIN_VERSION && decode_version(21300) >= LAST_ERROR_VERSION);
    }
}
