//! The Python exception hierarchy is declared once, in `llmsched.errors`; core errors map to it
//! variant by variant here.

use pyo3::import_exception;
use std::panic::AssertUnwindSafe;

use pyo3::{PyErr, PyResult, Python};

use llmsched_core::hashing::batch::BatchError;
use llmsched_core::hashing::HashError;
use llmsched_core::prefix_index::IndexError;
use llmsched_core::routing::replica_sync::SyncError;
use llmsched_core::routing::RoutingError;
use llmsched_core::vllm_events::DecodeError;
use llmsched_sim::KvError;

/// A core error turned into the Python exception it maps to. (A trait of this crate: Rust's
/// orphan rule forbids `From<CoreError> for PyErr` outside the crates that define either.)
pub(crate) trait ToPyErr {
    fn to_py_err(self) -> PyErr;
}

/// `result.py()?` propagates a core error as its Python exception.
pub(crate) trait CoreResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T, E: ToPyErr> CoreResult<T> for Result<T, E> {
    fn py(self) -> PyResult<T> {
        self.map_err(ToPyErr::to_py_err)
    }
}

import_exception!(llmsched.errors, InternalError);

/// Runs core code with the GIL released. A panic in it (a bug: the core validates its input and
/// returns errors) becomes `InternalError` instead of crossing into Python as pyo3's
/// `PanicException`, a `BaseException` that `except Exception` would not catch.
pub(crate) fn detach<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: Send + FnOnce() -> T,
{
    py.detach(|| std::panic::catch_unwind(AssertUnwindSafe(f))).map_err(internal_error)
}

/// [`detach`] for work too short to repay handing the GIL over and back: run with it held, a
/// panic still becoming `InternalError`.
pub(crate) fn attached<T, F>(f: F) -> PyResult<T>
where
    F: FnOnce() -> T,
{
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(internal_error)
}

/// [`detach`] when `long`, else [`attached`]: the callers' bounds (`DETACH_MIN_BLOCKS`,
/// `DETACH_MIN_PAYLOAD_BYTES`, `DETACH_MIN_TOKENS`) say when the work repays releasing the GIL,
/// since getting it back from a thread running Python waits out that thread's switch interval.
pub(crate) fn detach_if<T, F>(py: Python<'_>, long: bool, f: F) -> PyResult<T>
where
    T: Send,
    F: Send + FnOnce() -> T,
{
    if long {
        detach(py, f)
    } else {
        attached(f)
    }
}

fn internal_error(payload: Box<dyn std::any::Any + Send>) -> PyErr {
    let reason = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    InternalError::new_err(format!("internal error in llmsched's native core: {reason}"))
}

import_exception!(llmsched.errors, InvalidTokenError);
import_exception!(llmsched.errors, ConfigError);
import_exception!(llmsched.errors, GatewayStoppedError);
import_exception!(llmsched.errors, MalformedEventError);
import_exception!(llmsched.errors, UnknownWorkerError);
import_exception!(llmsched.errors, UnknownBlockError);
import_exception!(llmsched.errors, HashChainError);
import_exception!(llmsched.errors, SnapshotError);
import_exception!(llmsched.errors, NoEndpointError);
import_exception!(llmsched.errors, UnknownEndpointError);
import_exception!(llmsched.errors, DuplicateRequestError);
import_exception!(llmsched.errors, MalformedSyncBatchError);
import_exception!(llmsched.errors, InvalidValueError);
import_exception!(llmsched.errors, InvalidTypeError);
import_exception!(llmsched.errors, PlacementError);

impl ToPyErr for SyncError {
    fn to_py_err(self) -> PyErr {
        MalformedSyncBatchError::new_err(self.to_string())
    }
}

impl ToPyErr for HashError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        match err {
            HashError::ZeroBlockSize | HashError::BlockSizeTooLarge(_) => {
                ConfigError::new_err(err.to_string())
            }
            HashError::TokenOutOfRange { .. } => InvalidTokenError::new_err(err.to_string()),
        }
    }
}

impl ToPyErr for IndexError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        let msg = err.to_string();
        match err {
            IndexError::UnknownWorker(_) => UnknownWorkerError::new_err(msg),
            IndexError::UnknownParent(_)
            | IndexError::ParentNotHeld { .. }
            | IndexError::NotHeld { .. } => UnknownBlockError::new_err(msg),
            IndexError::Conflict(_) => HashChainError::new_err(msg),
            IndexError::InvalidConfig(_) => ConfigError::new_err(msg),
            IndexError::InvalidTtl(_) => InvalidValueError::new_err(msg),
            IndexError::Hash(h) => h.to_py_err(),
            IndexError::Decode(_) => MalformedEventError::new_err(msg),
            IndexError::Snapshot(_) => SnapshotError::new_err(msg),
        }
    }
}

import_exception!(llmsched.errors, UnknownRequestError);
import_exception!(llmsched.errors, SliceStateError);

impl ToPyErr for llmsched_core::slices::SliceError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        use llmsched_core::slices::SliceError as E;
        let message = err.to_string();
        match err {
            E::UnknownPolicy { .. } | E::BadParams { .. } => ConfigError::new_err(message),
            E::UnknownRequest(_) => UnknownRequestError::new_err(message),
            E::UnknownEndpoint(_) => UnknownWorkerError::new_err(message),
            E::DuplicateRequest(_)
            | E::WrongPhase { .. }
            | E::SliceOverrun { .. }
            | E::NotAtBoundary { .. } => SliceStateError::new_err(message),
            E::InvalidValue { .. } => InvalidValueError::new_err(message),
        }
    }
}

impl ToPyErr for llmsched_core::slices::AssemblyError {
    fn to_py_err(self) -> PyErr {
        use llmsched_core::slices::AssemblyError as E;
        match self {
            E::Unsupported(message) => ConfigError::new_err(message),
            E::State(message) => SliceStateError::new_err(message),
            E::Type(message) => InvalidTypeError::new_err(message),
            E::Value(message) => InvalidValueError::new_err(message),
        }
    }
}

impl ToPyErr for BatchError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        let message = err.to_string();
        match err.error {
            HashError::ZeroBlockSize | HashError::BlockSizeTooLarge(_) => {
                ConfigError::new_err(message)
            }
            HashError::TokenOutOfRange { .. } => InvalidTokenError::new_err(message),
        }
    }
}

impl ToPyErr for DecodeError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        MalformedEventError::new_err(err.to_string())
    }
}

impl ToPyErr for RoutingError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        let msg = err.to_string();
        match err {
            RoutingError::Config(e) => ConfigError::new_err(e.to_string()),
            RoutingError::NoEndpoint { .. } => NoEndpointError::new_err(msg),
            RoutingError::UnknownEndpoint(_) => UnknownEndpointError::new_err(msg),
            RoutingError::InvalidValue(_) => InvalidValueError::new_err(msg),
            RoutingError::Index(e) => e.to_py_err(),
            // A Python plugin's own exception comes back as it was raised.
            RoutingError::Plugin(e) => match e.source.downcast::<PyErr>() {
                Ok(py_err) => *py_err,
                Err(other) => pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "plugin {:?} failed: {other}",
                    e.plugin
                )),
            },
        }
    }
}

impl ToPyErr for KvError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        let msg = err.to_string();
        match err {
            KvError::InvalidConfig => ConfigError::new_err(msg),
            KvError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            KvError::DuplicateRequest(_) => DuplicateRequestError::new_err(msg),
        }
    }
}

import_exception!(llmsched.errors, InvalidRequestError);
import_exception!(llmsched.errors, PolicyError);

impl ToPyErr for llmsched_core::flow::FlowError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        use llmsched_core::flow::FlowError;
        let message = err.to_string();
        match err {
            FlowError::Config(_) => ConfigError::new_err(message),
            FlowError::InvalidInput(_) => InvalidRequestError::new_err(message),
            FlowError::DuplicateRequest(_) => DuplicateRequestError::new_err(message),
            FlowError::UnknownRequest(_) => UnknownRequestError::new_err(message),
        }
    }
}

impl ToPyErr for llmsched_sim::SimError {
    fn to_py_err(self) -> PyErr {
        let err = self;
        use llmsched_sim::SimError;
        match err {
            SimError::Config(_) | SimError::Plan(_) | SimError::Workload(_) => {
                ConfigError::new_err(err.to_string())
            }
            SimError::Kv(e) => e.to_py_err(),
            SimError::Index(e) => e.to_py_err(),
            SimError::Routing(e) => e.to_py_err(),
            SimError::Flow(e) => e.to_py_err(),
            SimError::Slices(e) => e.to_py_err(),
            SimError::Policy(e) => {
                Python::attach(|py| crate::sim_policy::policy_error(py, None, e))
            }
        }
    }
}

impl ToPyErr for llmsched_sim::WorkloadError {
    fn to_py_err(self) -> PyErr {
        ConfigError::new_err(self.0)
    }
}
