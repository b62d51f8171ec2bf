package tunnel

import (
	"net/netip"
	"testing"
	"time"

	"github.com/weft-net/weft/tunnel/conn/bindtest"
	"github.com/weft-net/weft/tunnel/crypt"
)

// TestForgedKeyIDsCounted: a flood of frames with new key ids from a
// peer's address (a pod or host forging it) costs a key derivation for the
// first few only; the rest are dropped unopened as key-budget, all are
// counted, and the peer's own traffic goes on.
func TestForgedKeyIDsCounted(t *testing.T) {
	net := bindtest.NewNetwork()
	// A clock that stands still, so that the budget never refills here.
	at := func() time.Time { return time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC) }
	a, b := pair(t, net, nodeOpts{psk: pskOne, now: at}, nodeOpts{psk: pskOne, now: at})
	exchange(t, a, b)
	const n = 100
	for i := range n {
		h := FrameHeader{Version: FrameVersion, Type: FrameData, Flags: FlagEncrypted, KeyID: uint32(1000 + i), Counter: 1}
		f := frame(h, make([]byte, 60+AEADTagLen))
		net.Inject(bindtest.Packet{From: netip.AddrPortFrom(underlayOf("a"), DefaultDataPort), To: netip.AddrPortFrom(underlayOf("b"), DefaultDataPort), Data: f})
	}
	waitFor(t, "every forged frame counted", func() bool {
		return dropped(b.d, dropAuth)+dropped(b.d, dropKeyBudget) == n
	})
	if got := dropped(b.d, dropAuth); got != crypt.DefaultKeyBudget {
		t.Errorf("%v forged frames cost a key derivation, want the budget of %d", got, crypt.DefaultKeyBudget)
	}
	expectNoPacket(t, b.tun.Outbound, "b")
	exchange(t, a, b)
}
