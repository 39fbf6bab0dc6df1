//! Loading libibverbs at run time: `dlopen` of the configured library and
//! the table of the (non-inline) verbs the backend calls. The data path
//! (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`) is not here: like
//! libibverbs' inline functions it jumps through the context's `ops`.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

use verbs_sys::*;

use crate::Error;

/// The library name opened when nothing else is configured.
pub const DEFAULT_LIB: &str = "libibverbs.so.1";

/// The verbs of one loaded library (function pointers resolved by `dlsym`).
#[allow(missing_docs)] // each field is the libibverbs function of its name
#[derive(Debug)]
pub struct Lib {
    /// The path or name it was opened by.
    pub name: String,
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    /// The exported (compat-layout) `ibv_query_port`, called as verbs.h's
    /// inline fallback does: on a zeroed full `ibv_port_attr`.
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, u32),
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
}

/// The library at `name` (a path, or a name the dynamic linker searches),
/// loaded once per process and never unloaded: a provider may run threads
/// and keep state for the process's life, so `dlclose` is never safe.
pub fn load(name: &str) -> Result<&'static Lib, Error> {
    load_in(name, false)
}

/// [`load`], with `isolated`: into a new link-map namespace (`dlmopen`
/// with `LM_ID_NEWLM`), a fresh copy of the library and its dependencies
/// whose calls to their own exported functions bind among themselves. A
/// libibverbs the program links is already bound to a preloaded
/// libnprdma.so's exports of the same names (libibverbs calls e.g.
/// `ibv_reg_mr_iova2` and `ibv_read_sysfs_file` through its PLT), so the
/// verbs shim loads the *next* libibverbs this way.
pub fn load_in(name: &str, isolated: bool) -> Result<&'static Lib, Error> {
    static LOADED: OnceLock<Mutex<HashMap<(String, bool), &'static Lib>>> = OnceLock::new();
    let mut map = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let key = (name.to_string(), isolated);
    if let Some(l) = map.get(&key) {
        return Ok(l);
    }
    let lib: &'static Lib = Box::leak(Box::new(open(name, isolated)?));
    map.insert(key, lib);
    Ok(lib)
}

fn open(name: &str, isolated: bool) -> Result<Lib, Error> {
    let load_err = |msg: String| Error::Load {
        lib: name.to_string(),
        msg,
    };
    let c = CString::new(name).map_err(|_| load_err("NUL in the name".into()))?;
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL;
    let h = if isolated {
        // SAFETY: a valid C string; a new namespace; plain flags.
        unsafe { libc::dlmopen(libc::LM_ID_NEWLM, c.as_ptr(), flags) }
    } else {
        // SAFETY: a valid C string; the flags are plain dlopen flags.
        unsafe { libc::dlopen(c.as_ptr(), flags) }
    };
    if h.is_null() {
        // SAFETY: dlerror returns NULL or a C string valid until the next dl call.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "dlopen failed".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated (see above).
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(load_err(msg));
    }
    let sym = |s: &'static str| -> Result<*mut c_void, Error> {
        let cs = CString::new(s).expect("no NUL");
        // SAFETY: `h` is a live handle (never closed), `cs` a C string.
        let p = unsafe { libc::dlsym(h, cs.as_ptr()) };
        if p.is_null() {
            Err(Error::Symbol {
                lib: name.to_string(),
                sym: s,
            })
        } else {
            Ok(p)
        }
    };
    macro_rules! f {
        ($s:literal) => {{
            let p = sym($s)?;
            // SAFETY: the symbol is the libibverbs function of that name,
            // whose C prototype (verbs.h) the field's type spells.
            unsafe { cast(p) }
        }};
    }
    Ok(Lib {
        name: name.to_string(),
        get_device_list: f!("ibv_get_device_list"),
        free_device_list: f!("ibv_free_device_list"),
        get_device_name: f!("ibv_get_device_name"),
        open_device: f!("ibv_open_device"),
        close_device: f!("ibv_close_device"),
        query_device: f!("ibv_query_device"),
        query_port: f!("ibv_query_port"),
        query_gid: f!("ibv_query_gid"),
        alloc_pd: f!("ibv_alloc_pd"),
        dealloc_pd: f!("ibv_dealloc_pd"),
        reg_mr: f!("ibv_reg_mr"),
        dereg_mr: f!("ibv_dereg_mr"),
        create_comp_channel: f!("ibv_create_comp_channel"),
        destroy_comp_channel: f!("ibv_destroy_comp_channel"),
        create_cq: f!("ibv_create_cq"),
        destroy_cq: f!("ibv_destroy_cq"),
        get_cq_event: f!("ibv_get_cq_event"),
        ack_cq_events: f!("ibv_ack_cq_events"),
        create_qp: f!("ibv_create_qp"),
        modify_qp: f!("ibv_modify_qp"),
        destroy_qp: f!("ibv_destroy_qp"),
    })
}

/// `p` as the function-pointer type `F`.
///
/// # Safety
/// `p` must be a function whose C prototype `F` spells.
unsafe fn cast<F>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller vouches for the type.
    unsafe { std::mem::transmute_copy(&p) }
}

/// The calling thread's `errno` as an error of `verb`.
pub fn errno_err(verb: &'static str) -> Error {
    Error::Verb {
        verb,
        source: std::io::Error::last_os_error(),
    }
}

/// A verbs return code (0, or an errno value, or -1 with `errno`) as a result.
pub fn check(verb: &'static str, rc: c_int) -> Result<(), Error> {
    match rc {
        0 => Ok(()),
        -1 => Err(errno_err(verb)),
        rc => Err(Error::Verb {
            verb,
            source: std::io::Error::from_raw_os_error(rc.abs()),
        }),
    }
}
