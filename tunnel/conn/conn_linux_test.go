package conn

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"os"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/weft-net/weft/tunnel/internal/netnstest"
)

func msg(addr string, n int, fill byte) Message {
	return Message{Data: bytes.Repeat([]byte{fill}, n), Addr: netip.MustParseAddrPort(addr)}
}

func testBatcher(ipip bool, maxSeg int) *batcher {
	b := &batcher{}
	b.init(nil, ipip, false, 2048)
	b.maxSeg = maxSeg
	b.gso.Store(!ipip)
	return b
}

// TestPack: runs of equal datagrams to one address become one GSO send;
// anything else starts a new one.
func TestPack(t *testing.T) {
	const a, b = "192.0.2.1:6784", "192.0.2.2:6784"
	var long []Message
	for range 70 {
		long = append(long, msg(a, 1000, 1))
	}
	for _, tc := range []struct {
		name  string
		msgs  []Message
		ipip  bool
		noGSO bool
		runs  []int
		sizes []int // UDP_SEGMENT per message, 0 for none
	}{
		{"one run", []Message{msg(a, 100, 1), msg(a, 100, 2), msg(a, 60, 3)}, false, false, []int{3}, []int{100}},
		{"nothing after a short one", []Message{msg(a, 100, 1), msg(a, 60, 2), msg(a, 60, 3)}, false, false, []int{2, 1}, []int{100, 0}},
		{"bigger breaks", []Message{msg(a, 100, 1), msg(a, 200, 2)}, false, false, []int{1, 1}, []int{0, 0}},
		{"other address", []Message{msg(a, 100, 1), msg(b, 100, 2), msg(b, 100, 3)}, false, false, []int{1, 2}, []int{0, 100}},
		{"too big for the path", []Message{msg(a, 1500, 1), msg(a, 1500, 2)}, false, false, []int{1, 1}, []int{0, 0}},
		{"at most 64 segments", long, false, false, []int{64, 6}, []int{1000, 1000}},
		{"gso off", []Message{msg(a, 100, 1), msg(a, 100, 2)}, false, true, []int{1, 1}, []int{0, 0}},
		{"ipip never joins", []Message{msg("192.0.2.1:0", 100, 1), msg("192.0.2.1:0", 100, 2)}, true, false, []int{1, 1}, []int{0, 0}},
	} {
		bt := testBatcher(tc.ipip, 1472)
		if tc.noGSO {
			bt.gso.Store(false)
		}
		s := bt.sendPool.Get().(*sendScratch)
		g := bt.pack(s, tc.msgs)
		var runs, sizes []int
		for i := range g {
			runs = append(runs, len(s.ms[i].Buffers))
			sizes = append(sizes, segSizeOf(s.ms[i].OOB))
		}
		if !equal(runs, tc.runs) || !equal(sizes, tc.sizes) {
			t.Errorf("%s: runs %v with segment sizes %v, want %v and %v", tc.name, runs, sizes, tc.runs, tc.sizes)
		}
		if s.first[g] != len(tc.msgs) {
			t.Errorf("%s: packed %d of %d", tc.name, s.first[g], len(tc.msgs))
		}
	}
	// A mark travels as IP_TOS on IPIP.
	bt := testBatcher(true, 1472)
	s := bt.sendPool.Get().(*sendScratch)
	m := msg("192.0.2.1:0", 100, 1)
	m.Mark = true
	bt.pack(s, []Message{m})
	if !bytes.Equal(s.ms[0].OOB, markOOB) {
		t.Error("marked IPIP message without its IP_TOS")
	}
}

func segSizeOf(oob []byte) int {
	if len(oob) == 0 {
		return 0
	}
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	if h.Level != unix.IPPROTO_UDP || h.Type != unix.UDP_SEGMENT {
		return -1
	}
	return int(binary.NativeEndian.Uint16(oob[unix.CmsgLen(0):]))
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestGROSize(t *testing.T) {
	b := make([]byte, unix.CmsgSpace(4))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = unix.IPPROTO_UDP, unix.UDP_GRO
	h.SetLen(unix.CmsgLen(4))
	binary.NativeEndian.PutUint32(b[unix.CmsgLen(0):], 1456)
	if got := groSize(b, 9000); got != 1456 {
		t.Errorf("groSize = %d", got)
	}
	for _, bad := range [][]byte{nil, b[:4], make([]byte, 16)} {
		if got := groSize(bad, 9000); got != 9000 {
			t.Errorf("groSize(% x) = %d, want the default", bad, got)
		}
	}
}

func TestParseIPIP(t *testing.T) {
	p := make([]byte, 40)
	p[0], p[1] = 0x45, MarkDSCP<<2|1 // ECN bits do not matter
	binary.BigEndian.PutUint16(p[2:], 40)
	p[9] = 4
	copy(p[12:16], []byte{192, 0, 2, 7})
	src, inner, mark, ok := parseIPIP(p)
	if !ok || src.Addr() != netip.MustParseAddr("192.0.2.7") || len(inner) != 20 || !mark {
		t.Errorf("parseIPIP = %v %d %v %v", src, len(inner), mark, ok)
	}
	for _, bad := range [][]byte{p[:10], append([]byte{0x65}, p[1:]...), append([]byte{0x44}, p[1:]...)} {
		if _, _, _, ok := parseIPIP(bad); ok {
			t.Errorf("parseIPIP(% x) accepted", bad[:4])
		}
	}
}

// inNetns runs fn inside a fresh namespace (loopback only).
func inNetns(t *testing.T, fn func()) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root to make a network namespace and raw sockets")
	}
	n, err := netnstest.Add(netnstest.Prefix(t) + "-c")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Del(); err != nil {
			t.Error(err)
		}
	})
	if err := n.Do(func() error { fn(); return nil }); err != nil {
		t.Fatal(err)
	}
}

// recvAll reads until n datagrams arrived or a deadline.
func recvAll(t *testing.T, b Bind, n int) []Message {
	t.Helper()
	var got []Message
	done := make(chan struct{})
	go func() {
		defer close(done)
		msgs := make([]Message, 16)
		for len(got) < n {
			k, err := b.Recv(msgs)
			if err != nil {
				return
			}
			for _, m := range msgs[:k] {
				m.Data = append([]byte(nil), m.Data...)
				got = append(got, m)
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		b.Close()
		<-done
		t.Fatalf("%d of %d datagrams arrived", len(got), n)
	}
	return got
}

// TestUDPBindLoopback: a GSO batch leaves as sent and arrives as the same
// datagrams, in order, whether the kernel joined them (GRO) or not.
func TestUDPBindLoopback(t *testing.T) {
	for _, noOffload := range []bool{false, true} {
		var a, b *UDPBind
		inNetns(t, func() {
			var err error
			if a, err = ListenUDP(netip.MustParseAddrPort("127.0.0.1:0"), UDPOptions{NoOffload: noOffload}); err != nil {
				t.Fatal(err)
			}
			if b, err = ListenUDP(netip.MustParseAddrPort("127.0.0.1:0"), UDPOptions{MaxDatagram: 2000, NoOffload: noOffload}); err != nil {
				t.Fatal(err)
			}
		})
		to := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), b.LocalPort())
		var msgs []Message
		for i := range 100 {
			n := 1200
			if i == 49 || i == 99 {
				n = 300 // ends a GSO run
			}
			m := msg(to.String(), n, byte(i))
			msgs = append(msgs, m)
		}
		if n, err := a.Send(msgs); err != nil || n != 100 {
			t.Fatalf("Send = %d, %v", n, err)
		}
		got := recvAll(t, b, 100)
		for i, m := range got {
			if !bytes.Equal(m.Data, msgs[i].Data) || m.Addr.Port() != a.LocalPort() {
				t.Fatalf("datagram %d: %d bytes of %d from %s", i, len(m.Data), m.Data[0], m.Addr)
			}
		}
		if gso, gro := a.Offload(); gso == noOffload || gro == noOffload {
			t.Errorf("offloads gso %v gro %v with NoOffload %v", gso, gro, noOffload)
		}
		a.Close()
		b.Close()
		if _, err := b.Recv(make([]Message, 1)); err != ErrClosed {
			t.Errorf("Recv after Close: %v", err)
		}
	}
}

// TestIPIPBindLoopback: packets sent on the raw socket arrive with the
// outer header taken off, the sender's address, and the mark.
func TestIPIPBindLoopback(t *testing.T) {
	var b *IPIPBind
	inNetns(t, func() {
		var err error
		if b, err = ListenIPIP(0); err != nil {
			t.Fatal(err)
		}
	})
	defer b.Close()
	to := netip.MustParseAddrPort("127.0.0.1:0")
	inner := make([]byte, 60)
	inner[0] = 0x45
	binary.BigEndian.PutUint16(inner[2:], 60)
	msgs := []Message{{Data: inner, Addr: to}, {Data: inner, Addr: to, Mark: true}}
	if n, err := b.Send(msgs); err != nil || n != 2 {
		t.Fatalf("Send = %d, %v", n, err)
	}
	got := recvAll(t, b, 2)
	for i, m := range got {
		if !bytes.Equal(m.Data, inner) || m.Addr.Addr() != to.Addr() || m.Mark != msgs[i].Mark {
			t.Errorf("packet %d: %d bytes from %s, mark %v", i, len(m.Data), m.Addr, m.Mark)
		}
	}
}
