package ipalloc

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func testRing(t testing.TB) *Ring {
	r := NewRing(rangeOf("10.32.0.0/12"))
	if err := r.ClaimEvenly([]PeerName{"node-a", "node-b", "node-c"}); err != nil {
		t.Fatal(err)
	}
	if err := r.GiveAway("node-b", "node-d", Range{r.Entries[1].Token + 16, r.Entries[1].Token + 32}); err != nil {
		t.Fatal(err)
	}
	return r
}

func testMsgs(t testing.TB) []Msg {
	r := testRing(t)
	b := Ballot{Round: 7, Peer: "node-a"}
	return []Msg{
		&RingMsg{Ring: r},
		&RingMsg{Ring: NewRing(r.Universe)},
		&PaxosMsg{Type: Prepare, Ballot: b},
		&PaxosMsg{Type: Promise, Ballot: b},
		&PaxosMsg{Type: Promise, Ballot: b, Accepted: Ballot{Round: 3, Peer: "node-c"}, Value: []PeerName{"node-a", "node-c"}},
		&PaxosMsg{Type: Accept, Ballot: b, Value: []PeerName{"node-a", "node-b", "node-c"}},
		&PaxosMsg{Type: Accepted, Ballot: b, Value: []PeerName{"node-a"}},
		&PaxosMsg{Type: Nack, Ballot: b, Accepted: Ballot{Round: 9, Peer: "node-b"}},
		&DonateRequest{ID: 0xdeadbeef12345678},
		&Donation{ID: 42, Ring: r},
		&Denial{ID: 1},
		&Remove{Peer: "node-c"},
		&Remove{Peer: "node-c", By: "node-a"},
		&RemoveAck{Peer: "node-c", Ring: r},
		&RemoveAck{Peer: "node-c", Ring: r, Members: []PeerName{"node-b", "node-d"}},
		&Handover{ID: 9, Ring: r},
		&HandoverAck{ID: 9},
		&HandoverAck{ID: 9, Heir: "node-b"},
		&AskRemoved{Peers: []PeerName{"node-c", "node-d"}},
		&RemoveAck{Peer: "node-c", Ring: r, Members: []PeerName{"node-b"}, InUse: []Address{r.Entries[2].Token, r.Entries[2].Token + 3}},
		&RemoveAck{Peer: "node-c", Ring: r, InUse: []Address{0, 0xffffffff}},
		&Want{Addrs: []Address{r.Entries[0].Token + 1}},
		&Want{Addrs: []Address{r.Entries[0].Token + 1, r.Entries[0].Token + 2, r.Entries[2].Token + 9}},
		&Members{Ask: true, Peers: []PeerName{"node-b", "node-c"}},
		&Members{Peers: []PeerName{"node-d"}},
		&Members{Ask: true},
		&Members{Peers: []PeerName{"node-d"}, InUse: []Address{r.Entries[1].Token, r.Entries[1].Token + 7}},
		&Members{InUse: []Address{0xffffffff}},
	}
}

func TestCodecRoundTrip(t *testing.T) {
	for _, m := range testMsgs(t) {
		data := EncodeMsg(m)
		got, err := DecodeMsg(data)
		if err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		if !reflect.DeepEqual(got, m) {
			t.Errorf("round trip of %#v gave %#v", m, got)
		}
	}
	r := testRing(t)
	got, err := DecodeRing(EncodeRing(r))
	if err != nil || !got.Equal(r) {
		t.Fatalf("ring round trip: %v, %v", err, got)
	}
}

func TestCodecRefuses(t *testing.T) {
	ringMsg := EncodeMsg(&RingMsg{Ring: testRing(t)})
	unseeded := testRing(t)
	unseeded.Seed = 0
	badRing := testRing(t)
	badRing.Entries[1].Free = 1 << 30
	for _, tt := range []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "too short"},
		{"other format", []byte{9, 1}, "format 9"},
		{"unknown kind", []byte{wireFormat, 200}, "unknown kind"},
		{"truncated ring", ringMsg[:len(ringMsg)-3], "truncated"},
		{"trailing bytes", append(bytes.Clone(ringMsg), 0), "left over"},
		{"huge count", []byte{wireFormat, byte(kindRing), 10, 0, 0, 0, 10, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0x0f}, "more than the message can hold"},
		{"bad peer name", EncodeMsg(&Remove{Peer: "a b"}), "printable ASCII"},
		{"long peer name", EncodeMsg(&Remove{Peer: PeerName(strings.Repeat("x", 65))}), "peer name of 65 bytes"},
		{"unseeded ring", EncodeMsg(&RingMsg{Ring: unseeded}), "without a seed"},
		{"invalid ring", EncodeMsg(&RingMsg{Ring: badRing}), "more than the range's"},
		{"paxos without ballot", []byte{wireFormat, byte(kindPrepare), 0, 0, 0}, "no ballot"},
		{"paxos unsorted value", EncodeMsg(&PaxosMsg{Type: Accept, Ballot: Ballot{1, "a"}, Value: []PeerName{"b", "a"}}), "not sorted"},
		{"remove of a newer weft", append(EncodeMsg(&Remove{Peer: "c"}), 2, 1, 'a'), "fields of version 2"},
		{"remove by a bad name", EncodeMsg(&Remove{Peer: "c", By: "a b"}), "printable ASCII"},
		{"remove ack members of a newer weft", append(EncodeMsg(&RemoveAck{Peer: "c", Ring: testRing(t)}), 3, 0), "fields of version 3"},
		{"remove ack in use without addresses", append(EncodeMsg(&RemoveAck{Peer: "c", Ring: testRing(t)}), removeAckInUseVersion, 0, 0), "without addresses"},
		{"remove ack in use unsorted", append(EncodeMsg(&RemoveAck{Peer: "c", Ring: testRing(t)}), removeAckInUseVersion, 0, 2, 5, 0), "not sorted"},
		{"want unsorted", []byte{wireFormat, byte(kindWant), 3, 1, 1, 0}, "not sorted and unique"},
		{"want past 32 bits", []byte{wireFormat, byte(kindWant), 2, 0xff, 0xff, 0xff, 0xff, 0x0f, 1}, "does not fit 32 bits"},
		{"members unsorted", EncodeMsg(&Members{Peers: []PeerName{"b", "a"}}), "not sorted and unique"},
		{"members bad flag", []byte{wireFormat, byte(kindMembers), 2, 0}, "flag 2"},
		{"members in use empty", []byte{wireFormat, byte(kindMembers), 0, 0, 0}, "empty list of addresses"},
		{"members in use unsorted", append(EncodeMsg(&Members{}), 2, 5, 0), "not sorted"},
		{"want huge count", []byte{wireFormat, byte(kindWant), 0xff, 0xff, 0x03}, "more than the message can hold"},
		{"remove ack bad member", EncodeMsg(&RemoveAck{Peer: "c", Ring: testRing(t), Members: []PeerName{"a b"}}), "printable ASCII"},
		{"remove ack huge member count", append(EncodeMsg(&RemoveAck{Peer: "c", Ring: testRing(t)}), removeAckExtVersion, 0xff, 0x7f), "more than the message can hold"},
		{"overlong number", []byte{wireFormat, byte(kindDenial), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, "overlong"},
	} {
		_, err := DecodeMsg(tt.data)
		if err == nil || !errors.Is(err, ErrBadMessage) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: DecodeMsg = %v, want ErrBadMessage saying %q", tt.name, err, tt.want)
		}
	}
	if _, err := DecodeRing([]byte{wireFormat}); err == nil {
		t.Error("DecodeRing of a truncated ring succeeded")
	}
}

// checkRoundTrip re-encodes a decoded message: it must decode to the same.
func checkRoundTrip(t *testing.T, m Msg) {
	again, err := DecodeMsg(EncodeMsg(m))
	if err != nil {
		t.Fatalf("re-encoding %#v: %v", m, err)
	}
	if !reflect.DeepEqual(again, m) {
		t.Fatalf("re-encoding %#v gave %#v", m, again)
	}
}

func FuzzDecodeRing(f *testing.F) {
	f.Add(EncodeRing(testRing(f)))
	f.Add(EncodeRing(NewRing(rangeOf("10.0.0.0/24"))))
	small := NewRing(Range{16, 32})
	_ = small.ClaimEvenly([]PeerName{"a", "b", "c"})
	f.Add(EncodeRing(small))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := DecodeRing(data)
		if err != nil {
			return
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("decoded an invalid ring: %v", err)
		}
		again, err := DecodeRing(EncodeRing(r))
		if err != nil || !again.Equal(r) {
			t.Fatalf("re-encoding: %v", err)
		}
		// A decoded ring is safe to merge into anything.
		other := testRing(t)
		_, _ = other.Merge(r)
		_, _ = r.Clone().Merge(other)
	})
}

// fuzzKinds fuzzes DecodeMsg for a set of kinds: the first byte picks one.
func fuzzKinds(f *testing.F, kinds []msgKind, seeds []Msg) {
	for _, m := range seeds {
		data := EncodeMsg(m)
		for i, k := range kinds {
			if k == msgKind(data[1]) {
				f.Add(byte(i), data[2:])
			}
		}
	}
	f.Fuzz(func(t *testing.T, sel byte, body []byte) {
		data := append([]byte{wireFormat, byte(kinds[int(sel)%len(kinds)])}, body...)
		m, err := DecodeMsg(data)
		if err != nil {
			return
		}
		checkRoundTrip(t, m)
		// A decoded message is safe to step into a peer.
		p, err := NewPeer(PeerConfig{Self: "node-x", Universe: rangeOf("10.32.0.0/12"), Init: Init{Consensus: 3}}, HardState{})
		if err != nil {
			t.Fatal(err)
		}
		_ = p.Step("node-a", m)
		p.Ready()
	})
}

func FuzzDecodePaxos(f *testing.F) {
	fuzzKinds(f, []msgKind{kindPrepare, kindPromise, kindAccept, kindAccepted, kindNack}, testMsgs(f))
}

func FuzzDecodeDonation(f *testing.F) {
	fuzzKinds(f, []msgKind{kindDonateRequest, kindDonation, kindDenial}, testMsgs(f))
}

func FuzzDecodeMsg(f *testing.F) {
	var kinds []msgKind
	for k := kindRing; k < kindEnd; k++ {
		kinds = append(kinds, k)
	}
	fuzzKinds(f, kinds, testMsgs(f))
}
