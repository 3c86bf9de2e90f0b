use proptest::prelude::*;

use super::*;

fn frames(parts: &[&[u8]]) -> Vec<Bytes> {
    parts.iter().map(|p| Bytes::copy_from_slice(p)).collect()
}

/// Every item of `wire`, fed in pieces cut at `cuts` (sorted offsets).
fn decode_cut(wire: &[u8], cuts: &[usize], cap: usize) -> Result<Vec<Item>, ZmqError> {
    let mut decoder = Decoder::new(cap);
    let mut buf = BytesMut::new();
    let mut items = Vec::new();
    let mut at = 0;
    for &end in cuts.iter().chain(std::iter::once(&wire.len())) {
        buf.extend_from_slice(&wire[at..end.max(at)]);
        at = end.max(at);
        while let Some(item) = decoder.decode(&mut buf)? {
            items.push(item);
        }
    }
    assert!(buf.is_empty(), "bytes left over");
    Ok(items)
}

/// A wire holding one of every frame form: short and long message frames, an empty frame, a
/// multipart message mixing them, short and long commands.
fn every_form() -> (Vec<u8>, Vec<Item>) {
    let long = vec![7u8; 300];
    let big_data = vec![9u8; 400];
    let messages = [frames(&[b"topic"]), frames(&[b"", &long, b"x"]), frames(&[b""])];
    let mut out = BytesMut::new();
    let mut items = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        put_message(&mut out, message);
        items.push(Item::Message(message.clone()));
        if i == 0 {
            put_command(&mut out, b"PING", b"\x00\x10ctx");
            items.push(Item::Command {
                name: Bytes::from_static(b"PING"),
                data: Bytes::from_static(b"\x00\x10ctx"),
            });
            put_command(&mut out, b"X-BIG", &big_data);
            items.push(Item::Command {
                name: Bytes::from_static(b"X-BIG"),
                data: Bytes::from(big_data.clone()),
            });
        }
    }
    (out.to_vec(), items)
}

#[test]
fn frame_forms_on_the_wire() {
    let mut out = BytesMut::new();
    put_message(&mut out, &frames(&[b"ab", b""]));
    assert_eq!(&out[..], b"\x01\x02ab\x00\x00");
    let mut out = BytesMut::new();
    put_message(&mut out, &[Bytes::from(vec![0u8; 256])]);
    assert_eq!(&out[..9], b"\x02\x00\x00\x00\x00\x00\x00\x01\x00");
    assert_eq!(&subscription(b"kv")[..], b"\x00\x03\x01kv");
    assert_eq!(&pong(b"\x00\x0aabc")[..], b"\x04\x08\x04PONGabc");
    assert_eq!(&pong(b"\x00")[..], b"\x04\x05\x04PONG", "a short PING: no context");
    let ready = ready(Kind::Dealer);
    assert_eq!(&ready[..2], &[0x04, ready.len() as u8 - 2]);
    assert_eq!(&ready[2..8], b"\x05READY");
}

#[test]
fn every_form_decodes_split_anywhere() {
    let (wire, expected) = every_form();
    assert_eq!(decode_cut(&wire, &[], 1 << 20).unwrap(), expected);
    for cut in 0..=wire.len() {
        assert_eq!(decode_cut(&wire, &[cut], 1 << 20).unwrap(), expected, "cut at {cut}");
    }
    let bytewise: Vec<usize> = (0..wire.len()).collect();
    assert_eq!(decode_cut(&wire, &bytewise, 1 << 20).unwrap(), expected);
}

#[test]
fn a_declared_terabyte_is_refused_by_its_header() {
    // The probe's frame: a long frame of 1 TiB, with nothing of its body sent.
    let mut buf = BytesMut::from(&b"\x02\x00\x00\x01\x00\x00\x00\x00\x00"[..]);
    let capacity = buf.capacity();
    let err = Decoder::new(64 << 20).decode(&mut buf).unwrap_err();
    assert!(matches!(err, ZmqError::TooLarge { declared: 0x100_0000_0000, .. }), "{err}");
    assert!(err.is_protocol() && err.reported());
    assert_eq!(buf.capacity(), capacity, "nothing reserved");
    for declared in [u64::MAX, 1 << 63, (64 << 20) + 1] {
        let mut buf = BytesMut::new();
        buf.put_u8(0x02);
        buf.put_u64(declared);
        assert!(matches!(Decoder::new(64 << 20).decode(&mut buf), Err(ZmqError::TooLarge { .. })));
    }
    // A frame of exactly the cap is accepted (once it has arrived).
    let mut buf = BytesMut::new();
    buf.put_u8(0x02);
    buf.put_u64(1000);
    assert_eq!(Decoder::new(1000).decode(&mut buf).unwrap(), None);
}

#[test]
fn a_message_over_the_cap_in_several_frames_is_refused() {
    let mut decoder = Decoder::new(100);
    let mut wire = BytesMut::new();
    put_frame(&mut wire, MORE, &[1; 60]);
    put_frame(&mut wire, MORE, &[2; 40]); // 100: at the cap
    assert_eq!(decoder.decode(&mut wire).unwrap(), None);
    wire.extend_from_slice(b"\x00\x01"); // one more byte declared
    let err = decoder.decode(&mut wire).unwrap_err();
    assert!(matches!(err, ZmqError::TooLarge { declared: 101, cap: 100 }), "{err}");
    // The cap is per message: the next message starts from zero.
    let mut decoder = Decoder::new(100);
    let mut wire = BytesMut::new();
    put_message(&mut wire, &[Bytes::from(vec![0u8; 100])]);
    put_message(&mut wire, &[Bytes::from(vec![0u8; 100])]);
    assert!(matches!(decoder.decode(&mut wire), Ok(Some(Item::Message(_)))));
    assert!(matches!(decoder.decode(&mut wire), Ok(Some(Item::Message(_)))));
}

#[test]
fn too_many_frames_are_refused() {
    let mut wire = BytesMut::new();
    for _ in 0..MAX_FRAMES {
        put_frame(&mut wire, MORE, b"");
    }
    let mut decoder = Decoder::new(1 << 20);
    assert_eq!(decoder.decode(&mut wire).unwrap(), None);
    wire.extend_from_slice(b"\x00\x00");
    assert!(matches!(decoder.decode(&mut wire), Err(ZmqError::Protocol(_))));
    // MAX_FRAMES frames are a message.
    let mut wire = BytesMut::new();
    put_message(&mut wire, &vec![Bytes::new(); MAX_FRAMES]);
    assert!(
        matches!(Decoder::new(1).decode(&mut wire), Ok(Some(Item::Message(f))) if f.len() == MAX_FRAMES)
    );
}

#[test]
fn bad_frames_are_refused() {
    let mut big = BytesMut::new();
    big.put_u8(COMMAND | LONG);
    big.put_u64(MAX_COMMAND as u64 + 1);
    let cases: [(&str, &[u8]); 6] = [
        ("reserved flag bits", b"\x08\x00"),
        ("a command with MORE", b"\x05\x05\x04PING"),
        ("a command mid-message", b"\x01\x00\x04\x05\x04PING"),
        ("a command over MAX_COMMAND", &big),
        ("an empty command", b"\x04\x00"),
        ("a command name longer than its frame", b"\x04\x03\x09ab"),
    ];
    for (what, wire) in cases {
        let mut buf = BytesMut::from(wire);
        let result = Decoder::new(1 << 20).decode(&mut buf);
        assert!(result.as_ref().is_err_and(ZmqError::is_protocol), "{what}: {result:?}");
    }
}

#[test]
fn room_grows_with_what_arrives_not_with_what_is_declared() {
    let mut decoder = Decoder::new(64 << 20);
    let mut buf = BytesMut::new();
    buf.put_u8(LONG);
    buf.put_u64(60 << 20);
    buf.extend_from_slice(&[0; 100]);
    assert_eq!(decoder.decode(&mut buf).unwrap(), None);
    assert_eq!(decoder.room(buf.len()), MIN_ROOM, "a little, not 60 MiB");
    assert_eq!(decoder.room(1 << 20), 1 << 20, "then at most what has arrived");
    assert_eq!(decoder.room(61 << 20), (60 << 20) + 9 - buf.len(), "never past the frame");
}

#[test]
fn greetings() {
    let ours = greeting();
    assert_eq!(ours.len(), GREETING_LEN);
    for end in 0..=GREETING_LEN {
        check_greeting(&ours[..end]).unwrap();
    }
    let mut v31 = ours;
    v31[11] = 1;
    v31[32] = 1; // as-server, ignored
    check_greeting(&v31).unwrap();
    let refused = |mutate: &dyn Fn(&mut [u8; GREETING_LEN]), what: &str| {
        let mut g = ours;
        mutate(&mut g);
        let err = check_greeting(&g).unwrap_err();
        assert!(err.is_protocol(), "{what}: {err}");
    };
    refused(&|g| g[0] = b'G', "not a signature");
    refused(&|g| g[9] = 0x7E, "a bad signature end");
    refused(&|g| g[10] = 2, "ZMTP 2.0");
    refused(&|g| g[12..17].copy_from_slice(b"PLAIN"), "PLAIN");
    refused(&|g| g[12..17].copy_from_slice(b"CURVE"), "CURVE");
    refused(&|g| g[16] = b'X', "NULLX");
    // Garbage is refused at its first byte.
    assert!(check_greeting(b"G").is_err());
    assert!(check_greeting(b"GET / HTTP/1.1\r\n").is_err());
    assert!(check_greeting(b"\x16\x03\x01").is_err(), "a TLS hello");
}

#[test]
fn ready_properties() {
    let mut buf = ready(Kind::Sub);
    let Some(Item::Command { name, data }) = Decoder::new(1).decode(&mut buf).unwrap() else {
        panic!("not a command")
    };
    assert_eq!(&name[..], b"READY");
    assert_eq!(socket_type(&data).unwrap(), Some(&b"SUB"[..]));
    let props = b"\x08Identity\x00\x00\x00\x00\x0bsocket-type\x00\x00\x00\x03PUB";
    assert_eq!(socket_type(props).unwrap(), Some(&b"PUB"[..]), "names are case-insensitive");
    assert_eq!(socket_type(b"").unwrap(), None);
    for bad in [&b"\x0bSocket-Type\xff\xff\xff\xffPUB"[..], b"\x0bSocket", b"\x0bSocket-Type\x00"] {
        assert!(socket_type(bad).is_err(), "{bad:?}");
    }
    assert!(Kind::Sub.accepts(b"PUB") && Kind::Sub.accepts(b"XPUB") && !Kind::Sub.accepts(b"SUB"));
    assert!(Kind::Dealer.accepts(b"ROUTER") && !Kind::Dealer.accepts(b"PUB"));
}

proptest! {
    /// Any bytes: an item, more wanted, or an error; never a panic, never more than the cap.
    #[test]
    fn any_bytes_decode_without_panic(wire in proptest::collection::vec(any::<u8>(), 0..600)) {
        let mut decoder = Decoder::new(256);
        let mut buf = BytesMut::from(&wire[..]);
        while let Ok(Some(item)) = decoder.decode(&mut buf) {
            if let Item::Message(frames) = item {
                prop_assert!(frames.iter().map(Bytes::len).sum::<usize>() <= 256);
                prop_assert!(frames.len() <= MAX_FRAMES);
            }
        }
        prop_assert!(decoder.room(buf.len()) <= buf.len().max(MIN_ROOM));
    }

    /// Messages come out as they went in, whatever the cuts.
    #[test]
    fn messages_round_trip_cut_anywhere(
        messages in proptest::collection::vec(
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..5),
            1..6,
        ),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let mut wire = BytesMut::new();
        let mut expected = Vec::new();
        for message in &messages {
            let message: Vec<Bytes> = message.iter().map(|f| Bytes::from(f.clone())).collect();
            put_message(&mut wire, &message);
            expected.push(Item::Message(message));
        }
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(wire.len() + 1)).collect();
        cuts.sort_unstable();
        prop_assert_eq!(decode_cut(&wire, &cuts, 1 << 20).unwrap(), expected);
    }
}
