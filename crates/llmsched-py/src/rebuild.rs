//! Native values rebuilt from their fields: the constructors that `pickle` and `copy` call
//! through `llmsched._copying`, each taking its fields in a fixed order. A field that does not
//! convert raises naming the class and the field, as any constructor's bad input does; the
//! fields otherwise come from a value the core made, so nothing beyond their types and NaN is
//! checked.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyTuple};

use crate::errors::{InvalidTypeError, InvalidValueError};

/// A constructor's fields, read in order.
pub(crate) struct Fields<'a, 'py> {
    class: &'static str,
    names: Vec<&'static str>,
    values: &'a Bound<'py, PyTuple>,
    next: usize,
}

impl<'a, 'py> Fields<'a, 'py> {
    /// `values` as the fields `names` (space-separated) of `class`: one value each.
    pub(crate) fn new(
        class: &'static str,
        names: &'static str,
        values: &'a Bound<'py, PyTuple>,
    ) -> PyResult<Self> {
        let names: Vec<&'static str> = names.split(' ').collect();
        if values.len() != names.len() {
            return Err(InvalidTypeError::new_err(format!(
                "{class} takes its {} fields ({}), got {} values",
                names.len(),
                names.join(", "),
                values.len()
            )));
        }
        Ok(Self { class, names, values, next: 0 })
    }

    /// The next field, converted.
    pub(crate) fn next<T>(&mut self) -> PyResult<T>
    where
        T: for<'b> FromPyObject<'b, 'py>,
    {
        let name = self.names[self.next];
        let value = self.values.get_item(self.next)?;
        self.next += 1;
        field(self.class, name, &value)
    }

    /// The next field as it is (a payload the value only carries).
    pub(crate) fn next_any(&mut self) -> PyResult<Bound<'py, PyAny>> {
        let value = self.values.get_item(self.next)?;
        self.next += 1;
        Ok(value)
    }
}

/// `value` as field `name` of `class`: a bool is not a number here (pyo3 would read it as 0 or
/// 1), NaN is no float of any value, and a conversion error names the field instead of being
/// pyo3's bare `OverflowError`.
fn field<'py, T>(class: &str, name: &str, value: &Bound<'py, PyAny>) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    if value.is_instance_of::<PyBool>() {
        return Err(InvalidTypeError::new_err(format!("{class}: {name} must not be a bool")));
    }
    if value.cast::<PyFloat>().is_ok_and(|f| f.value().is_nan()) {
        return Err(InvalidValueError::new_err(format!("{class}: {name} must not be NaN")));
    }
    value.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        let message = format!("{class}: {name}: {e}");
        if e.is_instance_of::<PyTypeError>(value.py()) {
            InvalidTypeError::new_err(message)
        } else {
            InvalidValueError::new_err(message)
        }
    })
}
