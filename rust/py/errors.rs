//! The Python exception hierarchy is declared once, in `llmsched.errors`; core errors map to it
//! variant by variant here.

use pyo3::exceptions::PyValueError;
use pyo3::import_exception;
use pyo3::PyErr;

use crate::hashing::HashError;

import_exception!(llmsched.errors, InvalidTokenError);

impl From<HashError> for PyErr {
    fn from(err: HashError) -> PyErr {
        match err {
            HashError::ZeroBlockSize => PyValueError::new_err(err.to_string()),
            HashError::TokenOutOfRange { .. } => InvalidTokenError::new_err(err.to_string()),
        }
    }
}
