package meshtest

import (
	"errors"
	"io"
	"testing"
	"time"
)

func TestNetwork(t *testing.T) {
	n := NewNetwork()
	a, err := n.NewTransport("10.0.0.1:6783")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := n.NewTransport("10.0.0.2:6783")
	if _, err := n.NewTransport("10.0.0.1:6783"); !errors.Is(err, ErrAddrInUse) {
		t.Errorf("a second transport on a taken address: %v", err)
	}

	a.WriteTo([]byte("hi"), "10.0.0.2:6783")
	select {
	case p := <-b.PacketCh():
		if string(p.Buf) != "hi" || p.From.String() != "10.0.0.1:6783" {
			t.Errorf("got %q from %s", p.Buf, p.From)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("packet not delivered")
	}

	go func() {
		c := <-b.StreamCh()
		io.Copy(c, c) // echo
		c.Close()
	}()
	c, err := a.DialTimeout("10.0.0.2:6783", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("x"))
	buf := make([]byte, 1)
	if _, err := io.ReadFull(c, buf); err != nil || buf[0] != 'x' {
		t.Errorf("echo: %q, %v", buf, err)
	}
	c.Close()

	n.Partition([]string{"10.0.0.1:6783"}, []string{"10.0.0.2:6783"})
	a.WriteTo([]byte("lost"), "10.0.0.2:6783")
	if _, err := a.DialTimeout("10.0.0.2:6783", time.Second); err == nil {
		t.Error("dial across a partition succeeded")
	}
	n.Heal()
	b.Shutdown()
	b.Shutdown()
	if _, err := a.DialTimeout("10.0.0.2:6783", time.Second); err == nil {
		t.Error("dial to a shut down transport succeeded")
	}
	// A packet to a gone peer does not block.
	a.WriteTo([]byte("void"), "10.0.0.2:6783")
	if _, err := n.NewTransport("10.0.0.2:6783"); err != nil {
		t.Errorf("restart on a freed address: %v", err)
	}
	select {
	case p := <-b.PacketCh():
		t.Errorf("a packet %q crossed the partition", p.Buf)
	default:
	}
}

func TestLossy(t *testing.T) {
	n := NewNetwork()
	ta, _ := n.NewTransport("10.0.0.1:6783")
	tb, _ := n.NewTransport("10.0.0.2:6783")
	a := NewLossy(ta, 1, 1)
	b := NewLossy(tb, 0, 2)
	defer a.Shutdown()
	defer b.Shutdown()

	for range 10 {
		a.WriteTo([]byte("12345"), "10.0.0.2:6783")
	}
	if sent, lost := a.Packets(); sent != 10 || lost != 10 || a.BytesSent() != 50 {
		t.Errorf("sent %d lost %d bytes %d, want 10 10 50", sent, lost, a.BytesSent())
	}
	a.SetLoss(0)
	a.WriteTo([]byte("kept"), "10.0.0.2:6783")
	if p := <-b.PacketCh(); string(p.Buf) != "kept" {
		t.Errorf("got %q", p.Buf)
	}

	go func() {
		c := <-b.StreamCh()
		io.ReadFull(c, make([]byte, 3))
		c.Write([]byte("reply"))
		c.Close()
	}()
	c, err := a.DialTimeout("10.0.0.2:6783", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("abc"))
	io.ReadAll(c)
	c.Close()
	if got := a.BytesSent(); got != 50+4+3 {
		t.Errorf("a sent %d bytes, want 57", got)
	}
	if got := b.BytesSent(); got != 5 {
		t.Errorf("b sent %d bytes on its accepted stream, want 5", got)
	}
}

// TestLossyDelayAndMaxima: a delayed packet still arrives, intact even
// though the sender reuses its buffer, and the largest packet and stream
// are recorded.
func TestLossyDelayAndMaxima(t *testing.T) {
	n := NewNetwork()
	a, _ := n.NewTransport("10.0.0.1:6783")
	b, _ := n.NewTransport("10.0.0.2:6783")
	l := NewLossy(a, 0, 1)
	defer l.Shutdown()
	defer b.Shutdown()
	l.SetDelay(10 * time.Millisecond)
	buf := []byte("hello")
	l.WriteTo(buf, "10.0.0.2:6783")
	copy(buf, "XXXXX")
	l.WriteTo([]byte("hi"), "10.0.0.2:6783")
	// Both timers are 10 ms: either packet may come first, so take both.
	got := map[string]bool{}
	for range 2 {
		select {
		case p := <-b.PacketCh():
			got[string(p.Buf)] = true
		case <-time.After(5 * time.Second):
			t.Fatalf("delayed packets not delivered (got %v)", got)
		}
	}
	if !got["hello"] || !got["hi"] {
		t.Errorf("delayed packets %v, want hello and hi", got)
	}
	if got := l.MaxPacket(); got != 5 {
		t.Errorf("MaxPacket %d, want 5", got)
	}
	go func() {
		c := <-b.StreamCh()
		io.Copy(io.Discard, c)
		c.Close()
	}()
	c, err := l.DialTimeout("10.0.0.2:6783", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Write(make([]byte, 300))
	c.Write(make([]byte, 200))
	c.Close()
	if got := l.MaxStream(); got != 500 {
		t.Errorf("MaxStream %d, want 500 (both writes of one stream)", got)
	}
}
