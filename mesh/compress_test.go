package mesh

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/weft-net/weft/mesh/meshtest"
)

// memberlist's message types on the wire (net.go; part of its protocol).
const (
	mlCompressMsg = 9
	mlHasCrcMsg   = 12
)

// compressWatch counts the packets its peer sent compressed.
type compressWatch struct {
	*meshtest.Transport
	compressed, packets atomic.Int64
}

func (w *compressWatch) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	w.packets.Add(1)
	typ := -1
	switch {
	case len(b) > 5 && b[0] == mlHasCrcMsg: // a CRC header, then the message
		typ = int(b[5])
	case len(b) > 0:
		typ = int(b[0])
	}
	if typ == mlCompressMsg {
		w.compressed.Add(1)
	}
	return w.Transport.WriteToAddress(b, a)
}

// TestCompressionOffAndMixed: a peer with Config.NoCompression sends
// nothing compressed, one without compresses, and peers that differ on it
// still form one mesh and get each other's broadcasts and push-pull
// state: the receiver decodes a compressed message whatever its own
// setting.
func TestCompressionOffAndMixed(t *testing.T) {
	c := newCluster(t)
	var watches []*compressWatch
	c.wrap = func(tr *meshtest.Transport) memberlist.NodeAwareTransport {
		w := &compressWatch{Transport: tr}
		watches = append(watches, w)
		return w
	}
	var ps []*peer
	for i := 1; i <= 3; i++ {
		cfg := Config{NoCompression: i != 2}
		if i > 1 {
			cfg.Peers = []string{addrOf(1)}
		}
		ps = append(ps, c.start(i, cfg))
	}
	defer closeAll(t, ps...)
	waitStates(t, converge, ps, aliveAll(ps))

	// Repetitive broadcasts, which LZW shrinks, from each peer.
	long := strings.Repeat("x", 300)
	for i, p := range ps {
		if err := p.ch.Broadcast([]byte("set:" + long + string(rune('a'+i)))); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, converge, "every peer to have every peer's broadcast", func() bool {
		for _, p := range ps {
			if !p.set.has(long+"a", long+"b", long+"c") {
				return false
			}
		}
		return true
	})
	waitFor(t, converge, "the compressing peer to have sent a compressed packet", func() bool {
		return watches[1].compressed.Load() > 0
	})
	for _, i := range []int{0, 2} {
		if n := watches[i].compressed.Load(); n != 0 {
			t.Errorf("%s (NoCompression) sent %d compressed packets of %d", ps[i].m.Name(), n, watches[i].packets.Load())
		}
	}
}
