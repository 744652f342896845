//! The wire format round-trips every message exactly and rejects every
//! malformed byte string without panicking.

use hopscope_gpu_wire::*;

fn samples() -> Vec<Message> {
    vec![
        Message::Hello(Hello {
            pid: 4242,
            ppid: 1,
            cupti_version: 130401,
            clock: ClockSource::Callback,
            enabled: enabled::KERNEL | enabled::MEMCPY | enabled::API_DRIVER,
            init_mono_ns: 123_456_789,
            struct_sizes: [248, 112, 96, 104, 56, 40],
            cupti_lib: "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13".into(),
            comm: "VLLM::EngineCor".into(),
        }),
        Message::Device(Device {
            ordinal: 0,
            cc_major: 9,
            cc_minor: 0,
            sm_count: 132,
            total_mem_bytes: 150_000_000_000,
            driver_version: 13000,
            name: "NVIDIA H200".into(),
        }),
        Message::Name(Name { id: 7, name: "_Z10flash_fwdILi128EEvPKfS1_Pf—ünïcode".into() }),
        Message::Kernel(Kernel {
            start_ns: 1_000,
            end_ns: 2_000,
            device_id: 3,
            context_id: 1,
            stream_id: 7,
            correlation_id: 99,
            grid_id: -5,
            grid: [128, 2, 1],
            block: [256, 1, 1],
            static_shared_mem: 1024,
            dynamic_shared_mem: 49152,
            registers_per_thread: 96,
            launch_type: 0,
            name_id: 7,
            graph_id: 12,
            graph_node_id: 0xdead_beef_0000_0001,
        }),
        Message::Memcpy(Memcpy {
            start_ns: 5,
            end_ns: 5,
            bytes: 4096,
            copy_kind: 2,
            src_kind: 4,
            dst_kind: 3,
            flags: 1,
            device_id: 0,
            context_id: 1,
            stream_id: 7,
            correlation_id: 100,
            runtime_correlation_id: 101,
            graph_id: 0,
            graph_node_id: 0,
            peer: None,
        }),
        Message::Memcpy(Memcpy {
            start_ns: 10,
            end_ns: 20,
            bytes: 1 << 30,
            copy_kind: 10,
            src_kind: 4,
            dst_kind: 4,
            flags: 0,
            device_id: 0,
            context_id: 1,
            stream_id: 9,
            correlation_id: 102,
            runtime_correlation_id: 0,
            graph_id: 0,
            graph_node_id: 0,
            peer: Some(Peer { src_device_id: 0, src_context_id: 1, dst_device_id: 1, dst_context_id: 2 }),
        }),
        Message::Memset(Memset {
            start_ns: 30,
            end_ns: 31,
            bytes: 64,
            value: 0xab,
            device_id: 0,
            context_id: 1,
            stream_id: 7,
            correlation_id: 103,
            flags: 1,
            memory_kind: 4,
            graph_id: 3,
            graph_node_id: 4,
        }),
        Message::Sync(Sync {
            start_ns: 40,
            end_ns: 90,
            sync_type: 3,
            context_id: 1,
            stream_id: 7,
            correlation_id: 104,
            cuda_event_id: u32::MAX,
        }),
        Message::Api(Api {
            start_ns: 1,
            end_ns: 3,
            domain: ApiDomain::Runtime,
            class: ApiClass::GraphLaunch,
            cbid: 311,
            name_id: 8,
            process_id: 4242,
            thread_id: 4243,
            correlation_id: 105,
            return_value: 0,
        }),
        Message::Counters(Counters { values: vec![(Counter::RecordsDecoded as u16, 10), (Counter::DroppedNoAgent as u16, 3), (999, 1)] }),
        Message::Calibration(Calibration { offset_ns: -1_700_000_000_000_000_000, error_ns: 80, at_mono_ns: 77 }),
        Message::Goodbye,
    ]
}

#[test]
fn every_message_round_trips_exactly() {
    for m in samples() {
        let f = m.to_frame();
        assert_eq!(Message::try_from(f.as_slice()).unwrap(), m, "{m:?}");
        let (tag, payload, used) = split_frame(&f).unwrap().unwrap();
        assert_eq!((tag, used), (m.tag(), f.len()));
        assert_eq!(Message::decode_body(tag, payload).unwrap(), m);
    }
}

#[test]
fn every_strict_prefix_of_a_frame_is_rejected_without_panicking() {
    for m in samples() {
        let f = m.to_frame();
        for cut in 0..f.len() {
            assert!(Message::try_from(&f[..cut]).is_err(), "{m:?} cut at {cut}");
            assert!(matches!(split_frame(&f[..cut]), Ok(None)), "{m:?} cut at {cut}");
        }
        // A payload cut short but with a consistent length prefix is truncated.
        if f.len() > 5 {
            let mut short = f[..f.len() - 1].to_vec();
            let len = (short.len() - 4) as u32;
            short[..4].copy_from_slice(&len.to_le_bytes());
            let e = Message::try_from(short.as_slice()).unwrap_err();
            assert!(matches!(e, WireError::Truncated { .. }), "{m:?}: {e}");
            assert!(!e.is_fatal());
        }
    }
}

#[test]
fn trailing_bytes_in_a_payload_or_after_a_frame_are_rejected() {
    let mut f = Message::Goodbye.to_frame();
    f.push(0);
    assert!(matches!(Message::try_from(f.as_slice()), Err(WireError::TrailingBytes { .. })));
    let mut g = Message::Name(Name { id: 1, name: "k".into() }).to_frame();
    g.push(0);
    let len = (g.len() - 4) as u32;
    g[..4].copy_from_slice(&len.to_le_bytes());
    assert!(matches!(Message::try_from(g.as_slice()), Err(WireError::TrailingBytes { tag: tag::NAME, extra: 1 })));
}

#[test]
fn bad_lengths_tags_magic_versions_and_enums_are_named() {
    let zero = [0u8, 0, 0, 0];
    assert_eq!(Message::try_from(&zero[..]).unwrap_err(), WireError::FrameTooShort { len: 0 });
    let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
    let e = Message::try_from(&huge[..]).unwrap_err();
    assert!(e.is_fatal() && e.to_string().contains("exceeds the limit"), "{e}");
    assert_eq!(Message::try_from(&[1u8, 0, 0, 0, 200][..]).unwrap_err(), WireError::UnknownTag(200));

    let hello = samples().remove(0).to_frame();
    let mut bad = hello.clone();
    bad[5] = b'X';
    assert_eq!(Message::try_from(bad.as_slice()).unwrap_err(), WireError::BadMagic);
    let mut v2 = hello.clone();
    v2[9..11].copy_from_slice(&2u16.to_le_bytes());
    let e = Message::try_from(v2.as_slice()).unwrap_err();
    assert_eq!(e, WireError::UnsupportedVersion(2));
    assert_eq!(e.to_string(), "unsupported wire version 2 (this build speaks 1)");
    let mut clock = hello.clone();
    clock[23] = 9; // magic 4 + version 2 + pid 4 + ppid 4 + cupti 4 → offset 5+18
    assert_eq!(Message::try_from(clock.as_slice()).unwrap_err(), WireError::BadEnum { field: "clock", value: 9 });

    let api = samples().into_iter().find(|m| m.tag() == tag::API).unwrap().to_frame();
    let mut dom = api.clone();
    dom[5 + 16] = 3;
    assert_eq!(Message::try_from(dom.as_slice()).unwrap_err(), WireError::BadEnum { field: "api domain", value: 3 });
    let mut class = api;
    class[5 + 17] = 0;
    assert_eq!(Message::try_from(class.as_slice()).unwrap_err(), WireError::BadEnum { field: "api class", value: 0 });
}

#[test]
fn impossible_timestamps_and_name_id_zero_are_rejected() {
    for (start, end) in [(0u64, 10u64), (10, 9)] {
        let k = Kernel {
            start_ns: start,
            end_ns: end,
            device_id: 0,
            context_id: 0,
            stream_id: 0,
            correlation_id: 0,
            grid_id: 0,
            grid: [1; 3],
            block: [1; 3],
            static_shared_mem: 0,
            dynamic_shared_mem: 0,
            registers_per_thread: 0,
            launch_type: 0,
            name_id: 1,
            graph_id: 0,
            graph_node_id: 0,
        };
        let f = Message::Kernel(k).to_frame();
        assert_eq!(
            Message::try_from(f.as_slice()).unwrap_err(),
            WireError::BadTimestamps { tag: tag::KERNEL, start_ns: start, end_ns: end }
        );
    }
    let f = Message::Name(Name { id: 0, name: "x".into() }).to_frame();
    assert_eq!(Message::try_from(f.as_slice()).unwrap_err(), WireError::Invalid { field: "name id" });
}

#[test]
fn invalid_utf8_in_a_name_is_rejected() {
    let mut f = Message::Name(Name { id: 1, name: "ab".into() }).to_frame();
    let n = f.len();
    f[n - 1] = 0xff;
    assert_eq!(Message::try_from(f.as_slice()).unwrap_err(), WireError::BadUtf8 { field: "name" });
}

#[test]
fn over_long_names_are_cut_on_a_char_boundary() {
    let long = "é".repeat(MAX_STR); // 2 bytes each
    let f = Message::Name(Name { id: 1, name: long }).to_frame();
    let Message::Name(n) = Message::try_from(f.as_slice()).unwrap() else { panic!("not a name") };
    assert!(n.name.len() <= MAX_STR && n.name.len() >= MAX_STR - 1);
    assert!(n.name.chars().all(|c| c == 'é'));
}

#[test]
fn the_stream_decoder_reassembles_frames_split_at_every_byte() {
    let mut stream = Vec::new();
    for m in samples() {
        m.encode(&mut stream);
    }
    let want = samples();
    for chunk in [1usize, 2, 3, 7, 64, 4096] {
        let mut d = FrameDecoder::default();
        let mut got = Vec::new();
        for c in stream.chunks(chunk) {
            d.push(c);
            while let Some(m) = d.next_message() {
                got.push(m.unwrap());
            }
        }
        assert_eq!(got, want, "chunk size {chunk}");
        assert_eq!(d.pending(), 0);
    }
}

#[test]
fn the_stream_decoder_skips_a_bad_frame_and_stops_at_a_bad_length() {
    let mut stream = Vec::new();
    Message::Name(Name { id: 1, name: "a".into() }).encode(&mut stream);
    stream.extend_from_slice(&[1, 0, 0, 0, 250]); // unknown tag: skipped
    Message::Goodbye.encode(&mut stream);
    stream.extend_from_slice(&[0, 0, 0, 0]); // length 0: fatal
    Message::Goodbye.encode(&mut stream);
    let mut d = FrameDecoder::default();
    d.push(&stream);
    assert!(matches!(d.next_message(), Some(Ok(Message::Name(_)))));
    assert_eq!(d.next_message(), Some(Err(WireError::UnknownTag(250))));
    assert_eq!(d.next_message(), Some(Ok(Message::Goodbye)));
    let e = d.next_message().unwrap().unwrap_err();
    assert!(e.is_fatal());
    assert_eq!(d.next_message(), Some(Err(e)), "fatal errors stick");
}

/// Cheap deterministic fuzzing: random bytes and bit-flipped valid frames
/// never panic, and whatever decodes re-encodes to the same bytes.
#[test]
fn random_and_mutated_bytes_never_panic_and_accepted_frames_reencode_identically() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let frames: Vec<Vec<u8>> = samples().iter().map(Message::to_frame).collect();
    let mut accepted = 0;
    for i in 0..200_000 {
        let mut buf = if i % 2 == 0 {
            let n = (rnd() % 96) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| rnd() as u8).collect();
            if n >= 5 {
                let len = (n - 4) as u32;
                b[..4].copy_from_slice(&len.to_le_bytes());
                b[4] = (rnd() % 12) as u8;
            }
            b
        } else {
            frames[(rnd() % frames.len() as u64) as usize].clone()
        };
        if i % 2 == 1 {
            for _ in 0..1 + rnd() % 3 {
                let at = 4 + (rnd() as usize) % (buf.len() - 4);
                buf[at] ^= 1 << (rnd() % 8);
            }
        }
        if let Ok(m) = Message::try_from(buf.as_slice()) {
            accepted += 1;
            // Strings cannot carry the random byte patterns that don't round-trip;
            // everything else is fixed-width, so the re-encoding is identical.
            assert_eq!(m.to_frame(), buf, "{m:?}");
        }
        let mut d = FrameDecoder::default();
        d.push(&buf);
        while let Some(r) = d.next_message() {
            if r.is_err() && r.unwrap_err().is_fatal() {
                break;
            }
        }
    }
    assert!(accepted > 1000, "the mutations should still produce valid frames ({accepted})");
}

#[test]
fn counters_have_stable_ids_and_names() {
    for c in Counter::ALL {
        assert_eq!(Counter::try_from(c as u16).unwrap(), c);
        assert!(c.name().chars().all(|ch| ch.is_ascii_lowercase() || ch == '_'));
    }
    assert_eq!(Counter::RecordsDecoded as u16, 1);
    assert_eq!(Counter::DroppedNoAgent.name(), "dropped_no_agent");
    assert!(Counter::try_from(0).is_err());
    let c = Counters { values: vec![(4, 12)] };
    assert_eq!(c.get(Counter::DroppedNoAgent), Some(12));
    assert_eq!(c.get(Counter::RecordsSent), None);
}

#[test]
fn a_whole_graph_launch_name_is_told_as_one_by_its_reader_whatever_its_id() {
    for id in [0, 7, u32::MAX] {
        assert!(is_whole_graph_name(&whole_graph_name(id)), "{id}");
    }
    assert!(is_whole_graph_name("[CUDA graph]"));
    for other in ["[CUDA graph x]", "CUDA graph 3", "[CUDA graph 3", "[unnamed kernel]", "hs_exact_add"] {
        assert!(!is_whole_graph_name(other), "{other}");
    }
}
