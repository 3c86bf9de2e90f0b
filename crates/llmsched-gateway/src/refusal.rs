//! Refusals: a request the gateway answers itself with an OpenAI-shaped error (status, type,
//! message, and `x-llmsched-dropped-reason` / `Retry-After` where flow control or a limit
//! dropped it), and the SSE error events that end an answer cut after its head.

use std::borrow::Cow;

use hyper::header::HeaderValue;
use hyper::StatusCode;
use serde_json::{json, Value};

use crate::answer::{json_answer, Answer};
use crate::payload;

/// An OpenAI-shaped refusal of the gateway's own.
pub(crate) struct Refusal {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
    pub(crate) param: Option<Cow<'static, str>>,
    pub(crate) reason: Option<&'static str>,
    pub(crate) retry_after: Option<String>,
    pub(crate) close: bool,
}

impl Refusal {
    pub(crate) fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            kind,
            message: message.into(),
            param: None,
            reason: None,
            retry_after: None,
            close: false,
        }
    }

    pub(crate) fn param(mut self, param: impl Into<Cow<'static, str>>) -> Refusal {
        self.param = Some(param.into());
        self
    }

    /// The 400 for a body [`Payload::parse`] refuses (naming the field when it can).
    pub(crate) fn unreadable(problem: payload::Problem) -> Refusal {
        let refusal = Refusal::new(400, "invalid_request_error", problem.to_string());
        match problem.param() {
            Some(param) => refusal.param(param.to_owned()),
            None => refusal,
        }
    }

    pub(crate) fn dropped(mut self, reason: &'static str, retry_after: String) -> Refusal {
        self.reason = Some(reason);
        self.retry_after = Some(retry_after);
        self
    }

    /// The OpenAI-shaped error object: an answer's body, or an SSE error event's data.
    pub(crate) fn error_body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

const DROPPED_REASON_HEADER: &str = "x-llmsched-dropped-reason";

/// The 504 of a request whose deadline (`total_timeout_s`) passed before its answer began.
pub(crate) fn deadline_refusal() -> Refusal {
    Refusal::new(504, "timeout", DEADLINE_MESSAGE)
}

/// What a request whose deadline (`total_timeout_s`) passed is told.
const DEADLINE_MESSAGE: &str = "the request's deadline (timeouts.total_s) passed";

/// The error event ending an SSE answer the engine cut off (no `[DONE]` follows).
pub(crate) const CUT_EVENT: &str = "data: {\"error\":{\"message\":\"the engine's answer was cut \
off\",\"type\":\"upstream_error\",\"param\":null,\"code\":502}}\n\n";

/// The error event ending an SSE answer the request's own deadline (`timeouts.total_s`) cut:
/// the 504 it gets before its answer's head, as an event.
pub(crate) const DEADLINE_EVENT: &str = "data: {\"error\":{\"message\":\"the request's deadline \
(timeouts.total_s) passed\",\"type\":\"timeout\",\"param\":null,\"code\":504}}\n\n";

pub(crate) fn refusal(refused: &Refusal) -> Answer {
    let mut answer = json_answer(refused.status, &refused.error_body());
    if let Some(reason) = refused.reason {
        answer.headers_mut().insert(DROPPED_REASON_HEADER, HeaderValue::from_static(reason));
    }
    if let Some(after) = refused.retry_after.as_deref().and_then(|v| HeaderValue::from_str(v).ok())
    {
        answer.headers_mut().insert(hyper::header::RETRY_AFTER, after);
    }
    answer
}
