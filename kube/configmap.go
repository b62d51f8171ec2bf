package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/weft-net/weft/ipalloc"
)

// Data keys of the ConfigMap.
const (
	KeyPeers     = "peers"
	KeyReclaimed = "reclaimed"
	KeyClaim     = "claim"
)

// maxEntries bounds the peers and reclaimed maps read from the ConfigMap
// (a ConfigMap holds at most 1 MiB anyway).
const maxEntries = 20000

// PeerRecord is a router's entry in the ConfigMap's peers map.
type PeerRecord struct {
	Node       string    `json:"node"`
	Nickname   string    `json:"nickname,omitempty"`
	Registered time.Time `json:"registered,omitzero"`
	// Reclaimer marks a reclaim in progress: the peer that won the
	// compare-and-swap and takes this peer's ranges over.
	Reclaimer      string    `json:"reclaimer,omitempty"`
	ReclaimStarted time.Time `json:"reclaimStarted,omitzero"`
	// CalledOff names the reclaimer whose reclaim of this peer its
	// registration called off (the peer came back): that router withdraws
	// the reclaim in its allocator (Config.Withdraw) and then clears it.
	CalledOff string `json:"calledOff,omitempty"`
}

// ReclaimRecord remembers a finished reclaim in the reclaimed map.
type ReclaimRecord struct {
	Node string    `json:"node"`
	By   string    `json:"by"`
	At   time.Time `json:"at"`
}

// CorruptError is a ConfigMap key that does not decode or holds invalid
// values. weft does not overwrite it.
type CorruptError struct {
	Namespace, Name, Key string
	Err                  error
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("ConfigMap %s/%s, key %q: %v; fix or delete the key (kubectl -n %s edit configmap %s); "+
		"weft keeps running on its own state meanwhile", e.Namespace, e.Name, e.Key, e.Err, e.Namespace, e.Name)
}

func (e *CorruptError) Unwrap() error { return e.Err }

func (k *Kube) corrupt(key string, err error) error {
	return &CorruptError{Namespace: k.cfg.Namespace, Name: k.cfg.ConfigMapName, Key: key, Err: err}
}

// validName checks a peer name read from the ConfigMap.
func validName(p string) error { return ipalloc.ValidatePeerName(ipalloc.PeerName(p)) }

// validNode checks a node name read from the ConfigMap.
func validNode(n string) error {
	if errs := validation.IsDNS1123Subdomain(n); len(errs) > 0 {
		return fmt.Errorf("node name %q: %s", n, errs[0])
	}
	return nil
}

// decodePeers reads the peers map of data; a missing key is an empty map.
func (k *Kube) decodePeers(data map[string]string) (map[string]PeerRecord, error) {
	peers := map[string]PeerRecord{}
	s, ok := data[KeyPeers]
	if !ok || s == "" {
		return peers, nil
	}
	if err := json.Unmarshal([]byte(s), &peers); err != nil {
		return nil, k.corrupt(KeyPeers, fmt.Errorf("not a JSON object of peer name to record: %w", err))
	}
	if len(peers) > maxEntries {
		return nil, k.corrupt(KeyPeers, fmt.Errorf("%d entries, more than %d", len(peers), maxEntries))
	}
	for p, r := range peers {
		if err := validName(p); err != nil {
			return nil, k.corrupt(KeyPeers, err)
		}
		if err := validNode(r.Node); err != nil {
			return nil, k.corrupt(KeyPeers, fmt.Errorf("peer %s: %w", p, err))
		}
		if r.Reclaimer != "" {
			if err := validName(r.Reclaimer); err != nil {
				return nil, k.corrupt(KeyPeers, fmt.Errorf("peer %s: reclaimer: %w", p, err))
			}
		}
		if r.CalledOff != "" {
			if err := validName(r.CalledOff); err != nil {
				return nil, k.corrupt(KeyPeers, fmt.Errorf("peer %s: calledOff: %w", p, err))
			}
		}
	}
	return peers, nil
}

// decodeReclaimed reads the reclaimed map of data.
func (k *Kube) decodeReclaimed(data map[string]string) (map[string]ReclaimRecord, error) {
	done := map[string]ReclaimRecord{}
	s, ok := data[KeyReclaimed]
	if !ok || s == "" {
		return done, nil
	}
	if err := json.Unmarshal([]byte(s), &done); err != nil {
		return nil, k.corrupt(KeyReclaimed, fmt.Errorf("not a JSON object of peer name to record: %w", err))
	}
	if len(done) > maxEntries {
		return nil, k.corrupt(KeyReclaimed, fmt.Errorf("%d entries, more than %d", len(done), maxEntries))
	}
	for p, r := range done {
		if err := validName(p); err != nil {
			return nil, k.corrupt(KeyReclaimed, err)
		}
		if err := validName(r.By); err != nil {
			return nil, k.corrupt(KeyReclaimed, fmt.Errorf("peer %s: by: %w", p, err))
		}
	}
	return done, nil
}

// encode sets key of data to the JSON of v, or deletes it when v is empty.
func encode[V any](data map[string]string, key string, v map[string]V) error {
	if len(v) == 0 {
		delete(data, key)
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	data[key] = string(b)
	return nil
}

// getConfigMap reads the ConfigMap, retrying failures; found is false
// when it does not exist.
func (k *Kube) getConfigMap(ctx context.Context) (cm *corev1.ConfigMap, found bool, err error) {
	o := op{verb: "get", resource: "configmaps", name: k.cfg.ConfigMapName, ns: k.cfg.Namespace}
	err = k.call(ctx, o, func(ctx context.Context) error {
		var err error
		cm, err = k.cfg.Client.CoreV1().ConfigMaps(k.cfg.Namespace).Get(ctx, k.cfg.ConfigMapName, metav1.GetOptions{})
		return err
	})
	switch {
	case apierrors.IsNotFound(err):
		return nil, false, nil
	case err != nil:
		return nil, false, err
	}
	return cm, true, nil
}

// modify changes the ConfigMap's data by compare-and-swap: it reads the
// ConfigMap, lets fn change a copy of its data (fn returns false to write
// nothing, or an error to give up), and writes it back with the
// resourceVersion it read (creating the ConfigMap if it is missing). When
// another router wrote in between, it reads again and re-runs fn, after a
// short jittered wait. fn may thus run several times; it must depend only
// on the data it is given. what names the change in logs.
func (k *Kube) modify(ctx context.Context, what string, fn func(data map[string]string) (bool, error)) error {
	cms := k.cfg.Client.CoreV1().ConfigMaps(k.cfg.Namespace)
	for attempt := 0; ; attempt++ {
		cm, found, err := k.getConfigMap(ctx)
		if err != nil {
			return err
		}
		data := map[string]string{}
		if found {
			maps.Copy(data, cm.Data)
		}
		write, err := fn(data)
		if err != nil || !write {
			return err
		}
		if found {
			next := cm.DeepCopy()
			next.Data = data
			o := op{verb: "update", resource: "configmaps", name: k.cfg.ConfigMapName, ns: k.cfg.Namespace}
			err = k.call(ctx, o, func(ctx context.Context) error {
				_, err := cms.Update(ctx, next, metav1.UpdateOptions{})
				return err
			})
		} else {
			next := &corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{
					Name: k.cfg.ConfigMapName, Namespace: k.cfg.Namespace,
					Labels: map[string]string{"app.kubernetes.io/name": "weft", "app.kubernetes.io/managed-by": "weft"},
				},
				Data: data,
			}
			o := op{verb: "create", resource: "configmaps", name: k.cfg.ConfigMapName, ns: k.cfg.Namespace}
			err = k.call(ctx, o, func(ctx context.Context) error {
				_, err := cms.Create(ctx, next, metav1.CreateOptions{})
				return err
			})
		}
		switch {
		case err == nil:
			return nil
		case apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err):
			k.metrics.conflicts.Inc()
			msg := "kubernetes: ConfigMap " + k.cfg.Namespace + "/" + k.cfg.ConfigMapName + " changed under us (" + what + "): reading it again and retrying"
			if attempt == 0 {
				k.log.Info(msg)
			} else {
				k.log.Debug(msg, "attempt", attempt+1)
			}
			if err := k.wait(ctx, k.cfg.ConflictBackoff.Delay(attempt, k.rand())); err != nil {
				return err
			}
		case apierrors.IsNotFound(err):
			// Deleted between the read and the update: create it.
		default:
			return fmt.Errorf("%s: %w", what, err)
		}
	}
}

// RegisterPeer records peer (with its nickname) as running on this node in
// the ConfigMap, creating the ConfigMap if needed. It retries failures and
// conflicts until it is done or ctx ends; a corrupt peers key is an error
// (CorruptError). Run calls it with Config.PeerName.
func (k *Kube) RegisterPeer(ctx context.Context, peer, nickname string) error {
	if err := validName(peer); err != nil {
		return fmt.Errorf("registering in the ConfigMap: %w", err)
	}
	var before PeerRecord
	var had bool
	var doneBy ReclaimRecord
	var wasReclaimed bool
	var others []string
	err := k.modify(ctx, "registering peer "+peer, func(data map[string]string) (bool, error) {
		peers, err := k.decodePeers(data)
		if err != nil {
			return false, err
		}
		done, err := k.decodeReclaimed(data)
		if err != nil {
			return false, err
		}
		before, had = peers[peer]
		doneBy, wasReclaimed = done[peer]
		others = others[:0]
		for p, r := range peers {
			if p != peer && r.Node == k.cfg.NodeName && r.Reclaimer == "" {
				others = append(others, p)
			}
		}
		if had && before.Node == k.cfg.NodeName && before.Nickname == nickname && before.Reclaimer == "" {
			return false, nil
		}
		rec := PeerRecord{Node: k.cfg.NodeName, Nickname: nickname, Registered: k.cfg.Now().UTC(), CalledOff: before.CalledOff}
		switch {
		case had && before.Reclaimer != "":
			rec.CalledOff = before.Reclaimer
		case wasReclaimed:
			rec.CalledOff = doneBy.By
		}
		peers[peer] = rec
		return true, encode(data, KeyPeers, peers)
	})
	if err != nil {
		return fmt.Errorf("registering peer %s of node %s in ConfigMap %s/%s: %w", peer, k.cfg.NodeName, k.cfg.Namespace, k.cfg.ConfigMapName, err)
	}
	k.mu.Lock()
	k.registered = true
	k.mu.Unlock()
	switch {
	case had && before.Reclaimer != "":
		k.log.Error("kubernetes: peer "+before.Reclaimer+" had started to reclaim this peer's ranges (its node was gone); "+
			"this peer is running, so the reclaim is called off, and "+before.Reclaimer+" withdraws it unless it has taken the ranges over already "+
			"(then this peer allocates nothing: run weft reset --force here and restart it to join under a new name)",
			"peer", peer, "node", k.cfg.NodeName, "since", before.ReclaimStarted)
	case wasReclaimed:
		k.log.Error("kubernetes: this peer's ranges were being reclaimed by "+doneBy.By+" when its node was deleted; "+
			doneBy.By+" withdraws the reclaim unless it has taken the ranges over already: then peers refuse this peer and it allocates nothing; "+
			"run weft reset --force here (or remove its state) to join again under a new name",
			"peer", peer, "node", doneBy.Node, "at", doneBy.At)
	case !had || before.Node != k.cfg.NodeName:
		k.log.Info("kubernetes: registered this peer in the ConfigMap", "peer", peer, "node", k.cfg.NodeName,
			"configmap", k.cfg.Namespace+"/"+k.cfg.ConfigMapName)
	}
	for _, p := range others {
		k.log.Warn("kubernetes: the ConfigMap maps another peer to this node: it is not running here any more "+
			"(this node runs "+peer+"), but its ranges stay with it until its Node is deleted or weft rmpeer "+p+" is run",
			"other", p, "node", k.cfg.NodeName)
	}
	return nil
}

// Peers returns the ConfigMap's map of peer names to their records.
func (k *Kube) Peers(ctx context.Context) (map[string]PeerRecord, error) {
	cm, found, err := k.getConfigMap(ctx)
	if err != nil || !found {
		return map[string]PeerRecord{}, err
	}
	return k.decodePeers(cm.Data)
}
