//! The one way configuration crosses between Python and the core: Python objects (dicts, lists,
//! str, int, float, bool, None) become serde values with `pythonize`, and the core decodes them
//! with its own serde types (so a wrong key or type is named by the same messages everywhere);
//! structured results go back to Python the same way.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::errors::{ConfigError, InternalError, InvalidTypeError};

/// Nesting deeper than this is refused before conversion (configs are a few levels deep).
const MAX_DEPTH: usize = 32;

/// A Python config object as a serde value. It must be plain data (None, bool, int, float, str,
/// and dicts and lists of them), floats finite (JSON has no NaN or infinity, and a silent null
/// would hide the mistake); `what` names the config in errors, with the path of a bad value.
fn config_value(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Value> {
    check_plain(obj, what, &mut String::new(), 0)?;
    pythonize::depythonize::<Value>(obj).map_err(|err| {
        let err: PyErr = err.into();
        ConfigError::new_err(format!("{what}: {err}"))
    })
}

fn check_plain(
    obj: &Bound<'_, PyAny>,
    what: &str,
    path: &mut String,
    depth: usize,
) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(ConfigError::new_err(format!("{what}: nested more than {MAX_DEPTH} levels")));
    }
    let at = |path: &str| if path.is_empty() { String::new() } else { format!(" at {path}") };
    if let Ok(float) = obj.cast::<PyFloat>() {
        let value = float.value();
        if !value.is_finite() {
            let at = at(path);
            return Err(ConfigError::new_err(format!(
                "{what}: value{at} must be finite, got {value}"
            )));
        }
    } else if let Ok(dict) = obj.cast::<PyDict>() {
        for (key, value) in dict.iter() {
            let len = path.len();
            path.push_str(&format!(".{key}"));
            check_plain(&value, what, path, depth + 1)?;
            path.truncate(len);
        }
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        for (i, value) in obj.try_iter()?.enumerate() {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            check_plain(&value?, what, path, depth + 1)?;
            path.truncate(len);
        }
    } else if !(obj.is_none()
        || obj.is_instance_of::<PyBool>()
        || obj.is_instance_of::<PyInt>()
        || obj.is_instance_of::<PyString>())
    {
        let kind = obj.get_type().name()?;
        return Err(ConfigError::new_err(format!(
            "{what}: value{} is a {kind}; only plain data (None, bool, int, float, str, and dicts \
             and lists of them) is accepted",
            at(path)
        )));
    }
    Ok(())
}

/// A structured result (anything serde can write) as plain Python objects.
pub(crate) fn to_python<'py, T: Serialize>(
    py: Python<'py>,
    value: &T,
) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, value).map_err(|err| {
        let err: PyErr = err.into();
        InternalError::new_err(format!("a result could not be converted to Python: {err}"))
    })
}

/// A Python object that must be a mapping, as a serde value (`None` is an empty mapping).
pub(crate) fn config_mapping(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Value> {
    match obj {
        None => Ok(Value::Object(Default::default())),
        Some(obj) if obj.is_none() => Ok(Value::Object(Default::default())),
        Some(obj) if obj.cast::<PyDict>().is_ok() => config_value(obj, what),
        Some(obj) => Err(InvalidTypeError::new_err(format!(
            "{what} must be a mapping, got {}",
            obj.get_type().name()?
        ))),
    }
}

/// A Python config object decoded into the core's serde type `T` (unknown keys and wrong types
/// are named in a `ConfigError`).
pub(crate) fn config_struct<T: DeserializeOwned>(
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<T> {
    let value = config_mapping(Some(obj), what)?;
    serde_json::from_value(value).map_err(|err| ConfigError::new_err(format!("{what}: {err}")))
}
