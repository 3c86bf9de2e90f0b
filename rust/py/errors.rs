//! The Python exception hierarchy is declared once, in `llmsched.errors`; core errors map to it
//! variant by variant here.

use pyo3::exceptions::PyValueError;
use pyo3::import_exception;
use pyo3::PyErr;

use crate::hashing::batch::BatchError;
use crate::hashing::HashError;
use crate::prefix_index::IndexError;
use crate::routing::RoutingError;
use crate::sim::KvError;
use crate::vllm_events::DecodeError;

import_exception!(llmsched.errors, InvalidTokenError);
import_exception!(llmsched.errors, ConfigError);
import_exception!(llmsched.errors, MalformedEventError);
import_exception!(llmsched.errors, UnknownWorkerError);
import_exception!(llmsched.errors, UnknownBlockError);
import_exception!(llmsched.errors, HashChainError);
import_exception!(llmsched.errors, SnapshotError);
import_exception!(llmsched.errors, NoEndpointError);
import_exception!(llmsched.errors, UnknownEndpointError);
import_exception!(llmsched.errors, DuplicateRequestError);

impl From<HashError> for PyErr {
    fn from(err: HashError) -> PyErr {
        match err {
            HashError::ZeroBlockSize => PyValueError::new_err(err.to_string()),
            HashError::TokenOutOfRange { .. } => InvalidTokenError::new_err(err.to_string()),
        }
    }
}

impl From<IndexError> for PyErr {
    fn from(err: IndexError) -> PyErr {
        let msg = err.to_string();
        match err {
            IndexError::UnknownWorker(_) => UnknownWorkerError::new_err(msg),
            IndexError::UnknownParent(_)
            | IndexError::ParentNotHeld { .. }
            | IndexError::NotHeld { .. } => UnknownBlockError::new_err(msg),
            IndexError::Conflict(_) => HashChainError::new_err(msg),
            IndexError::InvalidConfig(_) => ConfigError::new_err(msg),
            IndexError::InvalidTtl(_) => PyValueError::new_err(msg),
            IndexError::Hash(h) => h.into(),
            IndexError::Decode(_) => MalformedEventError::new_err(msg),
            IndexError::Snapshot(_) => SnapshotError::new_err(msg),
        }
    }
}

import_exception!(llmsched.errors, UnknownRequestError);
import_exception!(llmsched.errors, SliceStateError);

impl From<crate::slices::SliceError> for PyErr {
    fn from(err: crate::slices::SliceError) -> PyErr {
        use crate::slices::SliceError as E;
        let message = err.to_string();
        match err {
            E::UnknownPolicy { .. } | E::BadParams { .. } => ConfigError::new_err(message),
            E::UnknownRequest(_) => UnknownRequestError::new_err(message),
            E::UnknownEndpoint(_) => UnknownWorkerError::new_err(message),
            E::DuplicateRequest(_)
            | E::WrongPhase { .. }
            | E::SliceOverrun { .. }
            | E::NotAtBoundary { .. } => SliceStateError::new_err(message),
            E::InvalidValue { .. } => PyValueError::new_err(message),
        }
    }
}

impl From<BatchError> for PyErr {
    fn from(err: BatchError) -> PyErr {
        let message = err.to_string();
        match err.error {
            HashError::ZeroBlockSize => PyValueError::new_err(message),
            HashError::TokenOutOfRange { .. } => InvalidTokenError::new_err(message),
        }
    }
}

impl From<DecodeError> for PyErr {
    fn from(err: DecodeError) -> PyErr {
        MalformedEventError::new_err(err.to_string())
    }
}

impl From<RoutingError> for PyErr {
    fn from(err: RoutingError) -> PyErr {
        let msg = err.to_string();
        match err {
            RoutingError::Config(e) => ConfigError::new_err(e.to_string()),
            RoutingError::NoEndpoint { .. } => NoEndpointError::new_err(msg),
            RoutingError::UnknownEndpoint(_) => UnknownEndpointError::new_err(msg),
            RoutingError::InvalidValue(_) => PyValueError::new_err(msg),
            RoutingError::Index(e) => e.into(),
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

impl From<KvError> for PyErr {
    fn from(err: KvError) -> PyErr {
        let msg = err.to_string();
        match err {
            KvError::InvalidConfig => ConfigError::new_err(msg),
            KvError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            KvError::DuplicateRequest(_) => DuplicateRequestError::new_err(msg),
        }
    }
}

import_exception!(llmsched.errors, InvalidRequestError);

impl From<crate::flow::FlowError> for PyErr {
    fn from(err: crate::flow::FlowError) -> PyErr {
        use crate::flow::FlowError;
        let message = err.to_string();
        match err {
            FlowError::Config(_) => ConfigError::new_err(message),
            FlowError::InvalidInput(_) => InvalidRequestError::new_err(message),
            FlowError::DuplicateRequest(_) => DuplicateRequestError::new_err(message),
            FlowError::UnknownRequest(_) => UnknownRequestError::new_err(message),
        }
    }
}

impl From<crate::sim::SimError> for PyErr {
    fn from(err: crate::sim::SimError) -> PyErr {
        use crate::sim::SimError;
        match err {
            SimError::Config(_) | SimError::Plan(_) => ConfigError::new_err(err.to_string()),
            SimError::Kv(e) => e.into(),
            SimError::Index(e) => e.into(),
            SimError::Routing(e) => e.into(),
        }
    }
}
