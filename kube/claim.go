package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/weft-net/weft/ipalloc"
)

// maxClaimPeers bounds the peers of a claim read from the ConfigMap.
const maxClaimPeers = 10000

// Claim is the first claim of the ring as recorded in the ConfigMap: the
// ring's seed identifies it (rings of different seeds are refused by the
// allocator), the rest says what it was for an operator. In the ConfigMap
// (key "claim") the seed is written as 16 hex digits, as weft status
// prints it:
//
//	{"seed":"1f2e3d4c5b6a7988","universe":"10.32.0.0/12","peers":["a","b"],"by":"a","time":"2025-01-02T03:04:05Z"}
type Claim struct {
	Seed     ipalloc.Seed // the ring's seed; never zero
	Universe netip.Prefix // the pod range the ring covers
	Peers    []string     // the peers that shared the empty ring, if known
	By       string       // the peer that recorded it
	Time     time.Time    // when it was recorded
}

type claimJSON struct {
	Seed     string    `json:"seed"`
	Universe string    `json:"universe"`
	Peers    []string  `json:"peers,omitempty"`
	By       string    `json:"by"`
	Time     time.Time `json:"time,omitzero"`
}

// MarshalJSON writes the ConfigMap form.
func (c Claim) MarshalJSON() ([]byte, error) {
	return json.Marshal(claimJSON{Seed: c.Seed.String(), Universe: c.Universe.String(), Peers: c.Peers, By: c.By, Time: c.Time})
}

// UnmarshalJSON reads the ConfigMap form and validates it.
func (c *Claim) UnmarshalJSON(b []byte) error {
	var j claimJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	if len(j.Seed) != 16 {
		return fmt.Errorf("seed %q: want 16 hex digits", j.Seed)
	}
	s, err := strconv.ParseUint(j.Seed, 16, 64)
	if err != nil {
		return fmt.Errorf("seed %q: want 16 hex digits", j.Seed)
	}
	u, err := netip.ParsePrefix(j.Universe)
	if err != nil {
		return fmt.Errorf("universe %q: %w", j.Universe, err)
	}
	*c = Claim{Seed: ipalloc.Seed(s), Universe: u, Peers: j.Peers, By: j.By, Time: j.Time}
	return c.Validate()
}

// Validate checks c: a seed, an IPv4 universe in canonical form, valid
// peer names.
func (c Claim) Validate() error {
	if c.Seed == 0 {
		return errors.New("no seed")
	}
	if !c.Universe.IsValid() || !c.Universe.Addr().Is4() || c.Universe.Masked() != c.Universe {
		return fmt.Errorf("universe %s: want an IPv4 CIDR such as 10.32.0.0/12", c.Universe)
	}
	if err := validName(c.By); err != nil {
		return fmt.Errorf("by: %w", err)
	}
	if len(c.Peers) > maxClaimPeers {
		return fmt.Errorf("%d peers, more than %d", len(c.Peers), maxClaimPeers)
	}
	for _, p := range c.Peers {
		if err := validName(p); err != nil {
			return fmt.Errorf("peers: %w", err)
		}
	}
	return nil
}

func (c Claim) String() string {
	return fmt.Sprintf("seed %s of %s by %s (peers %s) at %s", c.Seed, c.Universe, c.By, strings.Join(c.Peers, ","), c.Time.Format(time.RFC3339))
}

// decodeClaim reads the claim of data.
func (k *Kube) decodeClaim(data map[string]string) (Claim, bool, error) {
	s, ok := data[KeyClaim]
	if !ok || s == "" {
		return Claim{}, false, nil
	}
	var c Claim
	if err := json.Unmarshal([]byte(s), &c); err != nil {
		return Claim{}, false, k.corrupt(KeyClaim, err)
	}
	return c, true, nil
}

// ClaimRecord reads the recorded first claim of the ring: ok is false when
// none is recorded (or the ConfigMap does not exist). It retries failures
// until it can answer or ctx ends; a corrupt claim key is a CorruptError.
func (k *Kube) ClaimRecord(ctx context.Context) (c Claim, ok bool, err error) {
	cm, found, err := k.getConfigMap(ctx)
	if err != nil || !found {
		return Claim{}, false, err
	}
	return k.decodeClaim(cm.Data)
}

// RecordClaim records c as the first claim of the ring unless one is
// recorded already; it returns the claim that is recorded now: c, or the
// earlier one, which then wins (the caller's ring is not the cluster's).
// It retries failures and conflicts until it is done or ctx ends; a
// corrupt claim key is a CorruptError and is not overwritten.
func (k *Kube) RecordClaim(ctx context.Context, c Claim) (Claim, error) {
	if c.Time.IsZero() {
		c.Time = k.cfg.Now().UTC()
	}
	if err := c.Validate(); err != nil {
		return Claim{}, fmt.Errorf("recording the first claim: %w", err)
	}
	var recorded Claim
	err := k.modify(ctx, "recording the first claim", func(data map[string]string) (bool, error) {
		old, ok, err := k.decodeClaim(data)
		if err != nil {
			return false, err
		}
		if ok {
			recorded = old
			return false, nil
		}
		b, err := json.Marshal(c)
		if err != nil {
			return false, err
		}
		data[KeyClaim] = string(b)
		recorded = c
		return true, nil
	})
	if err != nil {
		return Claim{}, fmt.Errorf("recording the first claim in ConfigMap %s/%s: %w", k.cfg.Namespace, k.cfg.ConfigMapName, err)
	}
	switch {
	case recorded.Seed == c.Seed && recorded.Time.Equal(c.Time) && recorded.By == c.By:
		k.log.Info("kubernetes: recorded the first claim of the ring", "claim", recorded.String())
	case recorded.Seed == c.Seed:
		k.log.Debug("kubernetes: the first claim of the ring is recorded already", "claim", recorded.String())
	default:
		k.log.Error("kubernetes: another first claim of the ring is recorded; this one is not the cluster's",
			"recorded", recorded.String(), "ours", c.String())
	}
	return recorded, nil
}

// KeyConsensus records the consensus size N of the first claim: the node
// count the first router saw. Every router without state adopts it, so
// that routers that saw different node counts at start count the same N
// (quorums of different sizes need not overlap; Weave's #3908).
const KeyConsensus = "consensus"

// RecordConsensus records n as the consensus size of the first claim
// unless one is recorded already, and returns the one recorded now: n, or
// the earlier one, which wins. It retries like RecordClaim; a corrupt
// value is a CorruptError and is not overwritten.
func (k *Kube) RecordConsensus(ctx context.Context, n int) (int, error) {
	if n < 1 || n > 10000 {
		return 0, fmt.Errorf("recording the consensus size: %d, not 1..10000", n)
	}
	var recorded int
	err := k.modify(ctx, "recording the consensus size", func(data map[string]string) (bool, error) {
		if s, ok := data[KeyConsensus]; ok && s != "" {
			v, err := strconv.Atoi(s)
			if err != nil || v < 1 || v > 10000 {
				return false, k.corrupt(KeyConsensus, fmt.Errorf("%q: want a number of nodes, 1..10000", s))
			}
			recorded = v
			return false, nil
		}
		data[KeyConsensus] = strconv.Itoa(n)
		recorded = n
		return true, nil
	})
	if err != nil {
		return 0, fmt.Errorf("recording the consensus size in ConfigMap %s/%s: %w", k.cfg.Namespace, k.cfg.ConfigMapName, err)
	}
	return recorded, nil
}
