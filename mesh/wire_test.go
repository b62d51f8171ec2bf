package mesh

import (
	"bytes"
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
)

func TestMessageRoundTrip(t *testing.T) {
	for _, kind := range []byte{kindBroadcast, kindUnicast} {
		b := encodeMessage(kind, "ipalloc", "ab:cd:ef:01:02:03", []byte("payload"))
		m, err := decodeMessage(b)
		if err != nil {
			t.Fatal(err)
		}
		if m.kind != kind || m.channel != "ipalloc" || m.from != "ab:cd:ef:01:02:03" || string(m.payload) != "payload" {
			t.Errorf("round trip: %+v", m)
		}
	}
	// The largest broadcast with the longest names fits a gossip packet
	// (1400 bytes minus memberlist's compound and user-message overhead).
	b := encodeMessage(kindBroadcast, strings.Repeat("c", MaxChannelName), PeerName(strings.Repeat("n", MaxNameLen)), make([]byte, MaxBroadcastSize))
	if len(b) > 1400-2-3 {
		t.Errorf("largest broadcast frame is %d bytes, over a gossip packet", len(b))
	}
}

func TestDecodeMessageReasons(t *testing.T) {
	good := encodeMessage(kindUnicast, "set", "node1", []byte("x"))
	for _, tc := range []struct {
		b    []byte
		want error
	}{
		{nil, ErrTruncated},
		{good[:5], ErrTruncated},
		{[]byte{2, 1}, ErrVersion},
		{append(bytes.Clone(good), 'x'), ErrMalformed},
		{[]byte{1, 1, 3, 's', 'e', 't', 1, 'a', 0xff, 0xff, 0xff, 0xff, 0x0f}, ErrOversized},
		{[]byte{1, 1, 3, 's', 'e', 't', 1, 'a', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, ErrMalformed},
	} {
		if _, err := decodeMessage(tc.b); !errors.Is(err, tc.want) {
			t.Errorf("decode %x: %v, want %v", tc.b, err, tc.want)
		}
	}
}

func TestStateRoundTrip(t *testing.T) {
	parts := []channelState{{"_topology", []byte{0}}, {"ipalloc", []byte("ring")}, {"empty", nil}}
	got, err := decodeState(encodeState(parts))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[1].channel != "ipalloc" || string(got[1].data) != "ring" || len(got[2].data) != 0 {
		t.Errorf("round trip: %+v", got)
	}
	dup := encodeState([]channelState{{"a", nil}, {"a", nil}})
	if _, err := decodeState(dup); !errors.Is(err, ErrMalformed) {
		t.Errorf("duplicate channel: %v", err)
	}
}

func TestReportRoundTrip(t *testing.T) {
	reps := []report{
		{Origin: "node1", Version: 1 << 62, Leaving: true},
		{Origin: "node2", Version: 5, Unreachable: []PeerName{"node3", "node4"}},
	}
	got, err := decodeReports(encodeReports(reps))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, reps) {
		t.Errorf("round trip: %+v, want %+v", got, reps)
	}
	for _, bad := range [][]byte{{}, {1}, {2, 1, 'a', 0, 0, 0}, {1, 1, 'a', 0, 2, 0}, {1, 0, 0, 0, 0}} {
		if r, err := decodeReport(bad); err == nil {
			t.Errorf("decoded %x as %+v", bad, r)
		}
	}
}

func TestParseMemberlistLine(t *testing.T) {
	for _, tc := range []struct {
		in    string
		msg   string
		level slog.Level
	}{
		{"[DEBUG] memberlist: Stream connection from=1.2.3.4\n", "Stream connection from=1.2.3.4", slog.LevelDebug},
		{"[INFO] memberlist: Marking x as failed\n", "Marking x as failed", slog.LevelInfo},
		{"[WARN] memberlist: Refuting\n", "Refuting", slog.LevelWarn},
		{"[ERR] memberlist: Conflicting address\n", "Conflicting address", slog.LevelError},
		{"[ERROR] something\n", "something", slog.LevelError},
		{"Err: Could not set the deadline\n", "Err: Could not set the deadline", slog.LevelInfo},
	} {
		msg, level := parseMemberlistLine([]byte(tc.in))
		if msg != tc.msg || level != tc.level {
			t.Errorf("%q: got %q at %v, want %q at %v", tc.in, msg, level, tc.msg, tc.level)
		}
	}
	var b bytes.Buffer
	l := memberlistLogger(slog.New(slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelWarn})), nil, nil)
	l.Printf("[DEBUG] memberlist: hidden")
	l.Printf("[ERR] memberlist: shown %d", 1)
	if s := b.String(); strings.Contains(s, "hidden") || !strings.Contains(s, `level=ERROR msg="shown 1" component=memberlist`) {
		t.Errorf("adapted log: %q", s)
	}
}

func TestSplitTarget(t *testing.T) {
	for _, tc := range []struct {
		in   string
		host string
		port int
		ok   bool
	}{
		{"10.0.0.2", "10.0.0.2", 6783, true},
		{"10.0.0.2:7000", "10.0.0.2", 7000, true},
		{"node2", "node2", 6783, true},
		{"node2.example:1", "node2.example", 1, true},
		{"fd00::1", "fd00::1", 6783, true},
		{"[fd00::1]:7000", "fd00::1", 7000, true},
		{"node2:0", "", 0, false},
		{"node2:x", "", 0, false},
		{":6783", "", 0, false},
		{"a/b", "", 0, false},
	} {
		host, port, err := splitTarget(tc.in, 6783)
		if (err == nil) != tc.ok || host != tc.host || port != tc.port {
			t.Errorf("splitTarget(%q) = %q, %d, %v", tc.in, host, port, err)
		}
	}
}

// "use of closed network connection" is the shutdown closing a socket
// under memberlist's read: at debug while the mesh closes, at its level
// otherwise; other errors keep theirs while closing.
func TestClosedConnQuietOnShutdown(t *testing.T) {
	var b bytes.Buffer
	var closing atomic.Bool
	l := memberlistLogger(slog.New(slog.NewTextHandler(&b, &slog.HandlerOptions{Level: slog.LevelInfo})), nil, closing.Load)
	line := "[ERR] memberlist: Error reading stream: read tcp 10.0.0.1:6783->10.0.0.2:4000: use of closed network connection"
	l.Print(line)
	if s := b.String(); !strings.Contains(s, "level=ERROR") {
		t.Errorf("a closed connection while running must stay an error: %q", s)
	}
	b.Reset()
	closing.Store(true)
	l.Print("[ERR] memberlist: Error accepting TCP connection: accept tcp 10.0.0.1:6783: use of closed network connection")
	if s := b.String(); s != "" {
		t.Errorf("a closed connection at shutdown was logged at info or above: %q", s)
	}
	l.Print("[ERR] memberlist: Failed to send gossip to 10.0.0.3:6783: connection refused")
	if s := b.String(); !strings.Contains(s, "level=ERROR") || !strings.Contains(s, "connection refused") {
		t.Errorf("a real error at shutdown must stay an error: %q", s)
	}
}
