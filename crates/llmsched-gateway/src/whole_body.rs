//! Reading a body whole within a byte limit, without the copies and the frame list a
//! collection keeps when the body comes in one frame.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Body;

/// A whole body's data read to its end: one frame's bytes as they came (no copy), several
/// frames' copied into one, empty frames and trailers skipped; `None` when the body fails
/// or its data passes `limit` bytes. What `Limited::new(body, limit).collect()` and
/// `to_bytes` gave, without the list of frames and the trailers' slot a collection keeps
/// per body (`whole_body_reads_as_the_collection_did` compares the two).
pub(crate) async fn whole_body<B>(mut body: B, limit: u64) -> Option<Bytes>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut first: Option<Bytes> = None;
    let mut rest: Vec<Bytes> = Vec::new();
    let mut left = limit;
    while let Some(frame) = body.frame().await {
        // Trailers are skipped; a frame with more data than is left of the limit ends the
        // read, as `Limited` refuses it.
        let Ok(data) = frame.ok()?.into_data() else { continue };
        left = left.checked_sub(data.len() as u64)?;
        if data.is_empty() {
            continue;
        }
        match first {
            None => first = Some(data),
            Some(_) => rest.push(data),
        }
    }
    Some(match first {
        None => Bytes::new(),
        Some(first) if rest.is_empty() => first,
        Some(first) => {
            let mut whole = bytes::BytesMut::with_capacity((limit - left) as usize);
            whole.extend_from_slice(&first);
            for data in rest {
                whole.extend_from_slice(&data);
            }
            whole.freeze()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http_body_util::Limited;
    use hyper::body::Frame;
    use hyper::HeaderMap;

    /// A body of the given frames, each ready when asked for.
    struct Frames(std::collections::VecDeque<Result<Frame<Bytes>, &'static str>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    /// A whole body of one frame (empty frames and trailers beside it) is that frame's
    /// bytes, not a copy; several frames' are one copy of them all.
    #[test]
    fn whole_body_keeps_a_single_frame_s_bytes() {
        let data = Bytes::from(vec![b'x'; 300]);
        let frames = Frames(
            [
                Ok(Frame::data(Bytes::new())),
                Ok(Frame::data(data.clone())),
                Ok(Frame::trailers(HeaderMap::new())),
            ]
            .into(),
        );
        let read = futures::executor::block_on(whole_body(frames, 300)).unwrap();
        assert_eq!(read.as_ptr(), data.as_ptr());
        assert_eq!(read.len(), 300);
        let frames = Frames([Ok(Frame::data(data.clone())), Ok(Frame::data(data.clone()))].into());
        assert_eq!(futures::executor::block_on(whole_body(frames, 599)), None);
        let frames = Frames([Ok(Frame::data(data.clone())), Ok(Frame::data(data.clone()))].into());
        let read = futures::executor::block_on(whole_body(frames, 600)).unwrap();
        assert_eq!(read, [&data[..], &data[..]].concat());
    }

    proptest::proptest! {
        /// A whole answer's body is read as `Limited::new(body, limit).collect()` and
        /// `to_bytes` read it: the same bytes, or none for a failed body or one past its
        /// limit; frames of any size, empty ones, trailers (first, between, last) and
        /// failures anywhere.
        #[test]
        fn whole_body_reads_as_the_collection_did(
            frames in proptest::collection::vec((0u8..10, 0usize..40), 0..8),
            limit in 0u64..160,
        ) {
            let made = || Frames(
                frames
                    .iter()
                    .enumerate()
                    .map(|(i, &(kind, size))| match kind {
                        0 => Err("failed"),
                        1 => Ok(Frame::trailers(HeaderMap::new())),
                        _ => Ok(Frame::data(Bytes::from(vec![b'a' + i as u8; size]))),
                    })
                    .collect(),
            );
            let before = futures::executor::block_on(
                Limited::new(made(), limit as usize).collect(),
            )
            .ok()
            .map(|collected| collected.to_bytes());
            let now = futures::executor::block_on(whole_body(made(), limit));
            proptest::prop_assert_eq!(&now, &before);
        }
    }
}
