//! Python lists and tuples of ints read in one native pass, with no Python call per element.
//!
//! A tokenizer hands the router a `list[int]` of 1,000 to 100,000 ids; converting it through
//! numpy or `int.__index__` element by element costs more than hashing and matching it. Here each
//! element is checked to be an exact `int` (not `bool`, not a subclass) by its type pointer, and
//! its value is read from the object:
//!
//! - directly from CPython's digit layout where this interpreter's layout was recognised when
//!   the module loaded (a self-test reads known ints, of one to three 30-bit digits and of both
//!   signs, and must get each right; 3.10-3.11 keep the sign and digit count in `ob_size`,
//!   3.12 and later in `lv_tag`), and the list's item array directly;
//! - else through `PyLong_AsUnsignedLongLong` and `PyList_GetItem` / `PyTuple_GetItem`.
//!
//! The object header is that of the interpreter the extension was built for: 16 bytes in the
//! GIL-enabled builds (the stable ABI's), 32 in the free-threaded ones (3.14t: thread id, mutex,
//! local and shared refcounts); the offsets below follow `ffi::PyObject`. A list is read inside a
//! critical section on it: without the GIL, another thread could otherwise resize it, or drop
//! its items, while they are read (a no-op with the GIL, which already excludes that).
//!
//! Any element that is not an exact int in range makes the reader give up (`None`, no Python
//! error left set): the caller then takes the general path, which raises the precise error for
//! that element (position, value, type) or converts what the general path accepts.

use std::sync::OnceLock;

use llmsched_core::prefetch::prefetch_ptr;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::critical_section::with_critical_section;
use pyo3::types::{PyList, PyTuple};

/// How this interpreter lays out an `int`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `ob_size` holds the sign and the number of 30-bit digits (CPython 3.10, 3.11).
    ObSize,
    /// `lv_tag` holds the digit count (<< 3) and the sign (low 2 bits) (CPython 3.12 and later).
    LvTag,
    /// Not recognised: read through the C API.
    Api,
}

/// The head of a `list` (`PyVarObject` then the item array), stable from 3.10 on (and in
/// 3.14t, after its longer object header); checked by the self-test before use.
#[repr(C)]
struct RawList {
    head: [u8; HEAD],
    ob_size: isize,
    ob_item: *mut *mut ffi::PyObject,
}

/// The object header's size: 16 bytes (refcount, type), 32 in a free-threaded build.
const HEAD: usize = std::mem::size_of::<ffi::PyObject>();

/// Byte offsets in an `int`: after the object header, the size or tag word, then the 30-bit
/// digits (at least one is always allocated).
const SIZE_OR_TAG: usize = HEAD;
const DIGITS: usize = HEAD + 8;

/// How far ahead of the id being read a list of token ids asks for its int objects. A list the
/// caller built long ago (or a large one) is read from memory: its 10,000 ints are 320 kB of
/// objects that the hardware prefetcher does not follow through the item pointers, and each
/// miss would stall the read. 256 items is about 0.4 us of reading ahead, several memory
/// latencies; 128 measured slower on cold lists, 384 the same as 256.
const PREFETCH_AHEAD: usize = 256;

/// [`PREFETCH_AHEAD`] for lists of hashes (one int object a 48-byte allocation, every item's
/// asked for).
const HASH_PREFETCH_AHEAD: usize = 64;

/// Asks for the cache line of `obj`'s size word and first digit (an int is 28 bytes and may
/// straddle two lines; its type word, in the line before, is that of the previous object in a
/// list whose ints were allocated one after the other).
#[inline(always)]
fn prefetch_int(obj: *mut ffi::PyObject) {
    prefetch_ptr(obj.cast::<u8>().wrapping_add(DIGITS));
}

static LAYOUT: OnceLock<Layout> = OnceLock::new();

fn layout(py: Python<'_>) -> Layout {
    *LAYOUT.get_or_init(|| detect(py))
}

fn detect(py: Python<'_>) -> Layout {
    let version = py.version_info();
    let candidate =
        if (version.major, version.minor) >= (3, 12) { Layout::LvTag } else { Layout::ObSize };
    let probes: [i128; 12] = [
        0,
        1,
        7,
        (1 << 30) - 1,
        1 << 30,
        (1 << 30) + 5,
        u32::MAX as i128,
        (1 << 60) + 7,
        u64::MAX as i128,
        -1,
        -(1 << 31),
        1 << 64,
    ];
    for p in probes {
        let Ok(obj) = p.into_pyobject(py);
        let want = u64::try_from(p).ok();
        // SAFETY: `obj` is a live exact int; a wrong guess of the layout reads inside the
        // object's allocation (at least 28 bytes for any int) and only gives a wrong value.
        let got = unsafe { read_long(candidate, obj.as_ptr()) };
        if got != want {
            return Layout::Api;
        }
    }
    let list = PyList::new(py, [11u64, 12, 13]);
    let Ok(list) = list else { return Layout::Api };
    // SAFETY: `list` is a live list of three items that no other thread has seen.
    let first = unsafe { (*(list.as_ptr() as *const RawList)).ob_item.read() };
    // SAFETY: same list; PyList_GetItem returns a borrowed reference or null.
    if first.is_null() || first != unsafe { ffi::PyList_GetItem(list.as_ptr(), 0) } {
        return Layout::Api;
    }
    candidate
}

/// The value of the exact int at `obj` when it is in `0..=u64::MAX`.
///
/// # Safety
/// `obj` must point to a live object of exact type `int`, attached to the interpreter.
unsafe fn read_long(layout: Layout, obj: *mut ffi::PyObject) -> Option<u64> {
    let base = obj as *const u8;
    let word = (base.add(SIZE_OR_TAG) as *const isize).read();
    let (negative, ndigits) = match layout {
        Layout::ObSize => (word < 0, word.unsigned_abs()),
        Layout::LvTag => {
            let tag = word as usize;
            (tag & 3 == 2, tag >> 3)
        }
        Layout::Api => return api_u64(obj),
    };
    if negative {
        return None;
    }
    let digits = base.add(DIGITS) as *const u32;
    // SAFETY: an int of `ndigits` digits has that many allocated (and at least one).
    let d = |i: usize| u64::from(unsafe { digits.add(i).read() });
    match ndigits {
        0 => Some(0),
        1 => Some(d(0)),
        2 => Some(d(0) | d(1) << 30),
        3 => {
            let top = d(2);
            (top < 16).then(|| d(0) | d(1) << 30 | top << 60)
        }
        _ => None,
    }
}

/// `PyLong_AsUnsignedLongLong`, with its error (negative, too large) cleared.
///
/// # Safety
/// `obj` must point to a live `int`, attached to the interpreter.
unsafe fn api_u64(obj: *mut ffi::PyObject) -> Option<u64> {
    let v = ffi::PyLong_AsUnsignedLongLong(obj);
    if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
        ffi::PyErr_Clear();
        return None;
    }
    Some(v)
}

/// Whether `obj` is an exact `int` (`bool` and other subclasses are not).
///
/// # Safety
/// `obj` must point to a live object, attached to the interpreter.
unsafe fn is_exact_int(obj: *mut ffi::PyObject) -> bool {
    ffi::Py_TYPE(obj) == std::ptr::addr_of_mut!(ffi::PyLong_Type)
}

/// Reads every element of a list or tuple `obj` as an int in `0..=max` into `out` (cleared
/// first). Returns false, leaving `out` unspecified, when `obj` is neither or any element is not
/// an exact int in range; no Python error is left set.
pub fn read_ints<T: TryFrom<u64>>(obj: &Bound<'_, PyAny>, max: u64, out: &mut Vec<T>) -> bool {
    out.clear();
    let py = obj.py();
    let lay = layout(py);
    let ptr = obj.as_ptr();
    if let Ok(list) = obj.cast::<PyList>() {
        return with_critical_section(list, || {
            let n = list.len();
            out.reserve(n);
            // SAFETY: the GIL (or, free-threaded, the list's critical section) is held and no
            // Python code runs in the loop, so the list cannot change under it; every item
            // pointer is a live object owned by the list.
            unsafe {
                if lay != Layout::Api {
                    let items = (*(ptr as *const RawList)).ob_item;
                    return match lay {
                        Layout::LvTag => read_items::<T, true>(lay, items, n, max, out),
                        _ => read_items::<T, false>(lay, items, n, max, out),
                    };
                }
                for i in 0..n {
                    let item = ffi::PyList_GetItem(ptr, i as ffi::Py_ssize_t);
                    if !push(lay, item, max, out) {
                        return false;
                    }
                }
            }
            true
        });
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let n = tuple.len();
        out.reserve(n);
        // SAFETY: as above; a tuple never changes.
        unsafe {
            for i in 0..n {
                let item = ffi::PyTuple_GetItem(ptr, i as ffi::Py_ssize_t);
                if !push(lay, item, max, out) {
                    return false;
                }
            }
        }
        return true;
    }
    false
}

/// Reads a list of token ids (exact ints in `0..2**32`) a block at a time: `on_block` gets each
/// full block of `block_size` ids as soon as they are read, so a caller can hash a block while
/// the next block's objects are still being loaded (a block's hash is a chain of dependent
/// multiplications that leaves the load units idle); the trailing partial block is checked but
/// not passed on. `buf` is the block buffer (resized here).
///
/// Returns false when `obj` is not a list, this interpreter's layout was not recognised, or an
/// element is not an exact int in range; `on_block` may have seen some blocks by then, and no
/// Python error is left set. The caller then takes the general path, which raises the precise
/// error (or converts what it accepts).
pub fn read_token_blocks(
    obj: &Bound<'_, PyAny>,
    block_size: usize,
    buf: &mut Vec<u32>,
    on_block: impl FnMut(&[u32]),
) -> bool {
    let py = obj.py();
    let lay = layout(py);
    let Ok(list) = obj.cast::<PyList>() else { return false };
    if lay == Layout::Api || block_size == 0 {
        return false;
    }
    buf.clear();
    buf.resize(block_size, 0);
    with_critical_section(list, || {
        // SAFETY: the GIL (or, free-threaded, the list's critical section) is held for the
        // whole call and neither the loop nor `on_block` (Rust code that only sees the buffer)
        // runs Python code, so the list and its items cannot change or be freed meanwhile; the
        // items are those of this live list.
        unsafe {
            let items = (*(list.as_ptr() as *const RawList)).ob_item;
            match lay {
                Layout::LvTag => token_blocks::<true>(items, list.len(), buf, on_block),
                _ => token_blocks::<false>(items, list.len(), buf, on_block),
            }
        }
    })
}

/// [`read_token_blocks`] for one layout (`LV_TAG`: 3.12 and later).
///
/// # Safety
/// `items` must be the item array of a live list of `n` items, with the list locked (by the
/// GIL or its critical section), in a layout the self-test recognised.
#[inline(always)]
unsafe fn token_blocks<const LV_TAG: bool>(
    items: *const *mut ffi::PyObject,
    n: usize,
    buf: &mut [u32],
    mut on_block: impl FnMut(&[u32]),
) -> bool {
    let token = |i: usize| int_at::<LV_TAG>(*items.add(i)).and_then(|v| u32::try_from(v).ok());
    let block_size = buf.len();
    let full = n - n % block_size;
    // The objects of every other item (two 32-byte ints to a cache line when they were
    // allocated in order): the first stretch at once, then, with each group of four ids read,
    // those of the group `PREFETCH_AHEAD` items on. A hint that costs about 0.1 ns an id when
    // the list is in the cache and saves 2-3 us of a 10,000-id list read from memory.
    for i in (0..PREFETCH_AHEAD.min(n)).step_by(2) {
        prefetch_int(*items.add(i));
    }
    for start in (0..full).step_by(block_size) {
        let mut j = 0;
        // Four ids at a time while all four are one-digit ints (any id from 1 to 2**30 - 1):
        // one test of the four types and sizes instead of a branch per test per id.
        while j + 4 <= block_size {
            if start + j + PREFETCH_AHEAD + 4 <= n {
                let ahead = items.add(start + j + PREFETCH_AHEAD);
                prefetch_int(*ahead);
                prefetch_int(*ahead.add(2));
            }
            let group = [0, 1, 2, 3].map(|k| *items.add(start + j + k));
            match one_digit_values::<LV_TAG>(group) {
                Some(values) => buf[j..j + 4].copy_from_slice(&values),
                None => {
                    for (k, slot) in buf[j..j + 4].iter_mut().enumerate() {
                        match token(start + j + k) {
                            Some(t) => *slot = t,
                            None => return false,
                        }
                    }
                }
            }
            j += 4;
        }
        for (k, slot) in buf[j..].iter_mut().enumerate() {
            match token(start + j + k) {
                Some(t) => *slot = t,
                None => return false,
            }
        }
        on_block(buf);
    }
    (full..n).all(|i| token(i).is_some())
}

/// The values of four items when all four are exact positive one-digit ints; None otherwise
/// (the caller then reads them one by one).
///
/// # Safety
/// As [`int_at`], for each item.
#[inline(always)]
unsafe fn one_digit_values<const LV_TAG: bool>(items: [*mut ffi::PyObject; 4]) -> Option<[u32; 4]> {
    // The size word of a positive one-digit int: the digit count, or the count << 3 with the
    // sign bits at zero.
    const ONE: [isize; 2] = [1, 1 << 3];
    let long_type = std::ptr::addr_of_mut!(ffi::PyLong_Type) as usize;
    // Types first: only an int is known to have a size word to read.
    if items.iter().any(|&item| ffi::Py_TYPE(item) as usize != long_type) {
        return None;
    }
    let size =
        |item: *mut ffi::PyObject| (item as *const u8).add(SIZE_OR_TAG).cast::<isize>().read();
    let odd = items.iter().fold(0, |acc, &item| acc | (size(item) ^ ONE[usize::from(LV_TAG)]));
    // SAFETY: each item is a one-digit int when `odd` is zero, so its first digit is allocated.
    (odd == 0).then(|| items.map(|item| (item as *const u8).add(DIGITS).cast::<u32>().read()))
}

/// The value of `item` when it is an exact int in `0..2**64` (up to three 30-bit digits), read
/// in the layout the self-test recognised (`LV_TAG`: 3.12 and later, else 3.10-3.11's).
///
/// # Safety
/// `item` must point to a live object, attached to the interpreter, and the layout must be the
/// interpreter's.
#[inline(always)]
unsafe fn int_at<const LV_TAG: bool>(item: *mut ffi::PyObject) -> Option<u64> {
    if ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyLong_Type) {
        return None;
    }
    let base = item as *const u8;
    let word = (base.add(SIZE_OR_TAG) as *const isize).read();
    let ndigits = if LV_TAG {
        if word & 3 == 2 {
            return None; // negative
        }
        (word as usize) >> 3
    } else {
        usize::try_from(word).ok()? // a negative size is a negative int
    };
    let digits = base.add(DIGITS) as *const u32;
    // SAFETY (each read): an int of `ndigits` digits has that many allocated.
    let d = |i: usize| u64::from(digits.add(i).read());
    // The two common sizes (token ids have one digit, 64-bit hashes three) as plain branches,
    // the rest out of line: with all four tests inline the compiler made them an indirect jump
    // through a table, which cost 4-5 ns an element of a list of hashes.
    if ndigits == 1 {
        Some(d(0))
    } else if ndigits == 3 {
        let top = d(2);
        (top < 16).then(|| d(0) | d(1) << 30 | top << 60)
    } else {
        other_size(ndigits, digits)
    }
}

/// [`int_at`] for the sizes other than one and three digits.
///
/// # Safety
/// `digits` must point to the digits of a live int of `ndigits` digits, attached to the interpreter.
#[cold]
#[inline(never)]
unsafe fn other_size(ndigits: usize, digits: *const u32) -> Option<u64> {
    match ndigits {
        0 => Some(0),
        // SAFETY: an int of two digits has both allocated.
        2 => Some(u64::from(digits.read()) | u64::from(digits.add(1).read()) << 30),
        _ => None,
    }
}

/// The floor of reading a list of ints: every item's type checked and its value read (up to
/// three 30-bit digits), as every converter above must, and nothing else done with them (the
/// values are only summed, so that the reads cannot be left out). With `prefetch`, each item's
/// object is asked for [`PREFETCH_AHEAD`] items ahead, as the token reader does. None when
/// `obj` is not a list, this interpreter's layout was not recognised, or an item is not an
/// exact int in `0..2**64`.
///
/// Benchmarks only (`_read_list_floor`): a cold list's conversion cannot cost less than this
/// pass over the same memory, so it bounds what any reader of that list can reach.
pub fn read_floor(obj: &Bound<'_, PyAny>, prefetch: bool) -> Option<u64> {
    let lay = layout(obj.py());
    let list = obj.cast::<PyList>().ok()?;
    if lay == Layout::Api {
        return None;
    }
    with_critical_section(list, || {
        // SAFETY: as in `read_ints`: the list is locked and no Python code runs in the loop.
        unsafe {
            let items = (*(list.as_ptr() as *const RawList)).ob_item;
            match (lay, prefetch) {
                (Layout::LvTag, true) => floor::<true, true>(items, list.len()),
                (Layout::LvTag, false) => floor::<true, false>(items, list.len()),
                (_, true) => floor::<false, true>(items, list.len()),
                (_, false) => floor::<false, false>(items, list.len()),
            }
        }
    })
}

/// [`read_floor`] for one layout and prefetch choice.
///
/// # Safety
/// As [`read_items`].
unsafe fn floor<const LV_TAG: bool, const PREFETCH: bool>(
    items: *const *mut ffi::PyObject,
    n: usize,
) -> Option<u64> {
    if PREFETCH {
        for i in 0..PREFETCH_AHEAD.min(n) {
            prefetch_int(*items.add(i));
        }
    }
    let mut sum = 0u64;
    for i in 0..n {
        if PREFETCH && i + PREFETCH_AHEAD < n {
            prefetch_int(*items.add(i + PREFETCH_AHEAD));
        }
        sum = sum.wrapping_add(int_at::<LV_TAG>(*items.add(i))?);
    }
    Some(sum)
}

/// Benchmarks only: [`read_floor`] from Python (`_read_list_floor(items, prefetch)`): the
/// wrapping sum of the ints of the list `items`, read as cheaply as any converter could read
/// them; an `InvalidTypeError` (a `TypeError`) for anything else.
#[pyfunction]
#[pyo3(name = "_read_list_floor")]
fn read_list_floor(items: &Bound<'_, PyAny>, prefetch: bool) -> PyResult<u64> {
    read_floor(items, prefetch).ok_or_else(|| {
        crate::errors::InvalidTypeError::new_err("items must be a list of ints in 0..2**64")
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_list_floor, m)?)
}

/// The list fast path, for one layout: every exact int of up to three 30-bit digits (all of
/// `0..2**64` that fits) is decoded in a tight loop; from the first other element on, elements
/// go through `push`.
///
/// # Safety
/// `items` must be the item array of a live list of `n` items, with the list locked (by the
/// GIL or its critical section), and `LV_TAG` the layout `lay` names (not `Api`).
unsafe fn read_items<T: TryFrom<u64>, const LV_TAG: bool>(
    lay: Layout,
    items: *const *mut ffi::PyObject,
    n: usize,
    max: u64,
    out: &mut Vec<T>,
) -> bool {
    let dst = out.as_mut_ptr();
    // Each item's object asked for `HASH_PREFETCH_AHEAD` items ahead (see `PREFETCH_AHEAD`):
    // a list of hashes read from memory otherwise waits on each 3-digit int in turn.
    for i in 0..HASH_PREFETCH_AHEAD.min(n) {
        prefetch_int(*items.add(i));
    }
    for i in 0..n {
        if i + HASH_PREFETCH_AHEAD < n {
            prefetch_int(*items.add(i + HASH_PREFETCH_AHEAD));
        }
        let value = int_at::<LV_TAG>(*items.add(i)).filter(|&v| v <= max);
        match value.and_then(|v| T::try_from(v).ok()) {
            // SAFETY: `out` has room for `n` elements (reserved by the caller).
            Some(t) => dst.add(i).write(t),
            None => {
                // The rest goes element by element after what was written so far.
                out.set_len(i);
                return (i..n).all(|j| push(lay, *items.add(j), max, out));
            }
        }
    }
    out.set_len(n);
    true
}

/// # Safety
/// `item` must be null or point to a live object, attached to the interpreter.
#[inline(always)]
unsafe fn push<T: TryFrom<u64>>(
    lay: Layout,
    item: *mut ffi::PyObject,
    max: u64,
    out: &mut Vec<T>,
) -> bool {
    if item.is_null() || !is_exact_int(item) {
        if item.is_null() {
            ffi::PyErr_Clear();
        }
        return false;
    }
    match read_long(lay, item) {
        Some(v) if v <= max => match T::try_from(v) {
            Ok(t) => {
                out.push(t);
                true
            }
            Err(_) => false,
        },
        _ => false,
    }
}
