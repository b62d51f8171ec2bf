package kube

import (
	"encoding/json"
	"testing"
)

// FuzzDecode: whatever the ConfigMap holds, decoding returns records that
// validate, or an error; it never panics.
func FuzzDecode(f *testing.F) {
	f.Add(`{"pa":{"node":"a","nickname":"a","registered":"2025-01-01T00:00:00Z"},"pc":{"node":"c","reclaimer":"pa"}}`,
		`{"pc":{"node":"c","by":"pa","at":"2025-01-01T00:00:00Z"}}`,
		`{"seed":"0123456789abcdef","universe":"10.32.0.0/12","peers":["a"],"by":"a"}`)
	f.Add(`{}`, `null`, `{"seed":""}`)
	f.Add(`{"a":{"node":""}}`, `{"x":{"by":""}}`, `{"seed":"ffffffffffffffff","universe":"10.0.0.0/8","by":"a","time":"x"}`)
	k, err := New(Config{Client: newCASFake(), NodeName: "a"})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, peers, reclaimed, claim string) {
		data := map[string]string{KeyPeers: peers, KeyReclaimed: reclaimed, KeyClaim: claim}
		if ps, err := k.decodePeers(data); err == nil {
			for p, r := range ps {
				if validName(p) != nil || validNode(r.Node) != nil || (r.Reclaimer != "" && validName(r.Reclaimer) != nil) {
					t.Errorf("invalid peer record accepted: %q %+v", p, r)
				}
			}
		}
		if done, err := k.decodeReclaimed(data); err == nil {
			for p, r := range done {
				if validName(p) != nil || validName(r.By) != nil {
					t.Errorf("invalid reclaim record accepted: %q %+v", p, r)
				}
			}
		}
		if c, ok, err := k.decodeClaim(data); err == nil && ok {
			if err := c.Validate(); err != nil {
				t.Errorf("invalid claim accepted: %+v: %v", c, err)
			}
			b, err := json.Marshal(c)
			if err != nil {
				t.Fatal(err)
			}
			var back Claim
			if err := json.Unmarshal(b, &back); err != nil || back.Seed != c.Seed || back.Universe != c.Universe {
				t.Errorf("claim does not round-trip: %s: %v", b, err)
			}
		}
	})
}
