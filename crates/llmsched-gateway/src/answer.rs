//! What the gateway answers a client with: an [`AnswerBody`] whole (its own answers, an
//! engine's answer read whole) or relayed frame by frame, and the gateway's own JSON answers.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::Value;

use crate::refusal::{refusal, Refusal};
use crate::relay::{Cut, Relay};
use crate::slicing;

pub(crate) type Answer = Response<AnswerBody>;

/// The body of an answer to a client: the gateway's own, whole (an engine's answer read
/// whole, a refusal), or passed on as it comes ([`Relay`]). The relay's state is boxed, so
/// that the whole answers, and every answer moved between the request's futures and hyper's
/// dispatcher, stay a few words.
pub enum AnswerBody {
    /// Sent as one frame.
    Whole(Option<Bytes>),
    /// An engine's answer (or a sliced request's stream), frame by frame.
    Relayed(Box<Relay>),
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        match self.get_mut() {
            AnswerBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            AnswerBody::Relayed(relay) => Pin::new(&mut **relay).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            AnswerBody::Whole(bytes) => bytes.is_none(),
            AnswerBody::Relayed(relay) => relay.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            AnswerBody::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            AnswerBody::Relayed(relay) => relay.size_hint(),
        }
    }
}

/// A 405 for a known path asked with another method, naming the one it takes.
pub(crate) fn method_not_allowed(allowed: &'static str) -> Answer {
    let problem = format!("this path takes {allowed} only");
    let mut answer = refusal(&Refusal::new(405, "method_not_allowed", problem));
    answer.headers_mut().insert(hyper::header::ALLOW, HeaderValue::from_static(allowed));
    answer
}

pub(crate) fn own(status: StatusCode, content_type: &'static str, body: Bytes) -> Answer {
    let mut out = Response::new(AnswerBody::Whole(Some(body)));
    *out.status_mut() = status;
    out.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    out
}

/// The SSE answer of a sliced request.
pub(crate) fn sliced_answer(stream: slicing::SliceStream) -> Answer {
    let mut relay = Relay::idle(StatusCode::OK);
    relay.sliced = Some(Box::new(stream));
    let mut out = Response::new(AnswerBody::Relayed(Box::new(relay)));
    out.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    out
}

pub(crate) fn json_answer(status: StatusCode, body: &Value) -> Answer {
    own(status, "application/json", serde_json::to_vec(body).unwrap_or_default().into())
}
