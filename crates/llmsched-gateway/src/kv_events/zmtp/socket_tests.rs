//! The sockets against hand-made peers (the Python tests run them against libzmq).

use futures::StreamExt;

use super::codec::put_command;
use super::*;

const PROBE: &[u8] = b"\x02\x00\x00\x01\x00\x00\x00\x00\x00"; // a long frame of 1 TiB

fn quick() -> SocketOptions {
    let mut options = SocketOptions::default();
    options.connect_timeout(Duration::from_millis(300)).reconnect_backoff((0.02, 0.1));
    options
}

/// A peer's side of the handshake as `socket_type`; returns what it read past the greeting.
async fn greet(stream: &mut TcpStream, socket_type: &[u8]) -> BytesMut {
    stream.write_all(&codec::greeting()).await.unwrap();
    let mut data = vec![11u8];
    data.extend_from_slice(b"Socket-Type");
    data.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    data.extend_from_slice(socket_type);
    let mut ready = BytesMut::new();
    put_command(&mut ready, b"READY", &data);
    stream.write_all(&ready).await.unwrap();
    let mut got = BytesMut::new();
    while got.len() < GREETING_LEN {
        assert!(stream.read_buf(&mut got).await.unwrap() > 0, "closed in the greeting");
    }
    codec::check_greeting(&got[..GREETING_LEN]).unwrap();
    got.advance(GREETING_LEN);
    got
}

/// Reads until `decoder` yields an item (None: the connection closed).
async fn next_item(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<Item> {
    let mut decoder = Decoder::new(1 << 20);
    loop {
        if let Some(item) = decoder.decode(buf).unwrap() {
            return Some(item);
        }
        if stream.read_buf(buf).await.unwrap_or(0) == 0 {
            return None;
        }
    }
}

/// A PUB peer connected to `address`, past READY and the subscription.
async fn publisher(address: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let mut buf = greet(&mut stream, b"PUB").await;
    assert!(matches!(next_item(&mut stream, &mut buf).await, Some(Item::Command { .. })));
    let Some(Item::Message(subscription)) = next_item(&mut stream, &mut buf).await else {
        panic!("no subscription")
    };
    assert_eq!(&subscription[0][..], b"\x01kv", "3.0's form: 0x01 then the topic");
    stream
}

async fn send(stream: &mut TcpStream, frames: &[&[u8]]) {
    let frames: Vec<Bytes> = frames.iter().map(|f| Bytes::copy_from_slice(f)).collect();
    let mut out = BytesMut::new();
    codec::put_message(&mut out, &frames);
    stream.write_all(&out).await.unwrap();
}

async fn event(monitor: &mut fmpsc::Receiver<SocketEvent>) -> SocketEvent {
    tokio::time::timeout(Duration::from_secs(5), monitor.next()).await.unwrap().unwrap()
}

async fn bound() -> (SubSocket, fmpsc::Receiver<SocketEvent>, String) {
    let mut sub = SubSocket::with_options(quick());
    let monitor = sub.monitor();
    sub.subscribe("kv").await.unwrap();
    let endpoint = sub.bind("tcp://127.0.0.1:*").await.unwrap();
    let address = endpoint.strip_prefix("tcp://").unwrap().to_owned();
    assert!(!address.ends_with(":0"), "the port bound is reported: {endpoint}");
    (sub, monitor, address)
}

#[tokio::test]
async fn bound_sub_merges_publishers_and_survives_a_terabyte_frame() {
    let (mut sub, mut monitor, address) = bound().await;
    let mut good = publisher(&address).await;
    assert!(matches!(event(&mut monitor).await, SocketEvent::Accepted(_)));
    // The probe: greeting, READY, then a frame header declaring 1 TiB.
    let mut hostile = publisher(&address).await;
    assert!(matches!(event(&mut monitor).await, SocketEvent::Accepted(_)));
    hostile.write_all(PROBE).await.unwrap();
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!("not dropped") };
    assert!(matches!(err, ZmqError::TooLarge { declared: 0x100_0000_0000, .. }), "{err}");
    assert!(matches!(event(&mut monitor).await, SocketEvent::Disconnected(_)));
    let mut rest = Vec::new();
    assert_eq!(hostile.read_to_end(&mut rest).await.unwrap_or(0), 0, "closed by the socket");
    // The other publisher goes on; two publishers' messages both arrive.
    let mut other = publisher(&address).await;
    send(&mut good, &[b"kv", b"1"]).await;
    send(&mut other, &[b"kv", b"2"]).await;
    let mut got = Vec::new();
    for _ in 0..2 {
        got.push(sub.recv().await.unwrap().into_vec()[1].clone());
    }
    got.sort();
    assert_eq!(got, [Bytes::from_static(b"1"), Bytes::from_static(b"2")]);
}

#[tokio::test]
async fn silent_garbage_and_foreign_peers_are_dropped() {
    let (_sub, mut monitor, address) = bound().await;
    // Connects and sends nothing: dropped at the connect timeout.
    let _silent = TcpStream::connect(&address).await.unwrap();
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!() };
    assert!(matches!(err, ZmqError::Timeout) && !err.is_protocol(), "{err}");
    // An HTTP request.
    let mut garbage = TcpStream::connect(&address).await.unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!() };
    assert!(err.is_protocol(), "{err}");
    // Another mechanism.
    let mut curve = TcpStream::connect(&address).await.unwrap();
    let mut greeting = codec::greeting();
    greeting[12..17].copy_from_slice(b"CURVE");
    curve.write_all(&greeting).await.unwrap();
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!() };
    assert!(err.to_string().contains("CURVE"), "{err}");
    // A SUB is not a publisher.
    let mut sub_peer = TcpStream::connect(&address).await.unwrap();
    greet(&mut sub_peer, b"SUB").await;
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!() };
    assert!(err.to_string().contains("a SUB peer"), "{err}");
    // A peer that closes at once is not reported.
    drop(TcpStream::connect(&address).await.unwrap());
    let _good = publisher(&address).await;
    assert!(matches!(event(&mut monitor).await, SocketEvent::Accepted(_)));
}

#[tokio::test]
async fn handshakes_in_progress_are_capped() {
    let (_sub, mut monitor, address) = bound().await;
    let mut silent = Vec::new();
    for _ in 0..=MAX_HANDSHAKES {
        silent.push(TcpStream::connect(&address).await.unwrap());
    }
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!() };
    assert!(matches!(err, ZmqError::Busy), "{err}");
}

#[tokio::test]
async fn ping_is_answered() {
    let (_sub, _monitor, address) = bound().await;
    let mut stream = publisher(&address).await;
    let mut ping = BytesMut::new();
    put_command(&mut ping, b"PING", b"\x00\x0actx");
    stream.write_all(&ping).await.unwrap();
    let mut buf = BytesMut::new();
    let Some(Item::Command { name, data }) = next_item(&mut stream, &mut buf).await else {
        panic!("no PONG")
    };
    assert_eq!((&name[..], &data[..]), (&b"PONG"[..], &b"ctx"[..]));
}

#[tokio::test]
async fn connecting_sub_reconnects_after_a_hostile_publisher() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let mut sub = SubSocket::with_options(quick());
    let mut monitor = sub.monitor();
    sub.subscribe("kv").await.unwrap();
    sub.connect(&format!("tcp://{address}")).await.unwrap();
    // The first connection: a 1 TiB frame.
    let (mut stream, _) = listener.accept().await.unwrap();
    greet(&mut stream, b"PUB").await;
    stream.write_all(PROBE).await.unwrap();
    assert!(matches!(event(&mut monitor).await, SocketEvent::Connected(_)));
    let SocketEvent::Dropped(_, err) = event(&mut monitor).await else { panic!() };
    assert!(matches!(err, ZmqError::TooLarge { .. }), "{err}");
    assert!(matches!(event(&mut monitor).await, SocketEvent::Disconnected(_)));
    // Made again with the backoff: a well-behaved one this time.
    let (mut stream, _) = listener.accept().await.unwrap();
    let mut buf = greet(&mut stream, b"XPUB").await;
    assert!(matches!(next_item(&mut stream, &mut buf).await, Some(Item::Command { .. })));
    assert!(matches!(next_item(&mut stream, &mut buf).await, Some(Item::Message(_))));
    assert!(matches!(event(&mut monitor).await, SocketEvent::Connected(_)));
    send(&mut stream, &[b"kv", b"after"]).await;
    assert_eq!(&sub.recv().await.unwrap().into_vec()[1][..], b"after");
}

#[tokio::test]
async fn dealer_talks_to_a_router_and_reports_a_hostile_one() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let router = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut buf = greet(&mut stream, b"ROUTER").await;
        assert!(matches!(next_item(&mut stream, &mut buf).await, Some(Item::Command { .. })));
        let Some(Item::Message(request)) = next_item(&mut stream, &mut buf).await else {
            panic!("no request")
        };
        assert_eq!(request, [Bytes::new(), Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 5])]);
        send(&mut stream, &[b"", b"seq", b"payload"]).await;
        stream.write_all(PROBE).await.unwrap();
        stream
    });
    let mut dealer = DealerSocket::with_options(quick());
    dealer.connect(&endpoint).await.unwrap();
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&5u64.to_be_bytes())];
    dealer.send(ZmqMessage::try_from(request).unwrap()).await.unwrap();
    assert_eq!(dealer.recv().await.unwrap().into_vec().len(), 3);
    let err = dealer.recv().await.unwrap_err();
    assert!(matches!(err, ZmqError::TooLarge { .. }), "{err}");
    assert!(matches!(dealer.recv().await, Err(ZmqError::NoMessage)));
    drop(router.await.unwrap());
    // A replay endpoint that never greets: the connect fails at the timeout.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", silent.local_addr().unwrap());
    let mut dealer = DealerSocket::with_options(quick());
    assert!(matches!(dealer.connect(&endpoint).await, Err(ZmqError::Timeout)));
}
