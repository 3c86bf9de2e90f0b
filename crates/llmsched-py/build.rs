//! Exposes PyO3's interpreter cfgs (`Py_GIL_DISABLED`, `Py_3_14`, `Py_LIMITED_API`, ...) to this
//! crate, so that the free-threaded build can call what only that interpreter has.
fn main() {
    pyo3_build_config::use_pyo3_cfgs();
}
