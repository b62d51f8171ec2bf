// Package state is a peer's durable state: one bbolt file under --state-dir,
// held with an exclusive lock so that two routers never share it. Packages
// keep their own buckets in it and commit before they act on what they wrote.
package state

import (
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterr "go.etcd.io/bbolt/errors"
)

// FileName is the database file inside the state dir.
const FileName = "weft.db"

// ErrLocked says another process holds the state dir.
var ErrLocked = errors.New("state dir is in use by another weft router")

// DB is the open state of one peer.
type DB struct {
	bolt *bolt.DB
	path string
}

// Open opens (creating if needed) the state in dir. It fails fast with
// ErrLocked when another router holds it.
func Open(dir string) (*DB, error) {
	if dir == "" {
		return nil, errors.New("--state-dir is empty: give a directory on the host that survives restarts, e.g. /var/lib/weft")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("cannot create --state-dir %s: %w (give a writable directory)", dir, err)
	}
	path := filepath.Join(dir, FileName)
	// Probe writability first, so the error names the cause rather than bbolt's.
	probe, err := os.CreateTemp(dir, ".probe-*")
	if err != nil {
		return nil, fmt.Errorf("--state-dir %s is not writable: %w", dir, err)
	}
	probe.Close()
	os.Remove(probe.Name())

	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if errors.Is(err, bolterr.ErrTimeout) {
		return nil, fmt.Errorf("%w: %s is locked; stop the other router or give this one its own --state-dir", ErrLocked, path)
	}
	if err != nil {
		return nil, fmt.Errorf("opening state %s: %w (if the file is corrupt, move it away; the peer then rejoins as new)", path, err)
	}
	return &DB{bolt: db, path: path}, nil
}

// Path is the database file.
func (d *DB) Path() string { return d.path }

// Close releases the file and its lock.
func (d *DB) Close() error { return d.bolt.Close() }

// Update runs fn in a read-write transaction on bucket, creating it if needed;
// the change is on disk when Update returns nil.
func (d *DB) Update(bucket string, fn func(*bolt.Bucket) error) error {
	return d.bolt.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucketIfNotExists([]byte(bucket))
		if err != nil {
			return err
		}
		return fn(b)
	})
}

// UpdateTx runs fn in one read-write transaction over any buckets: all of
// its writes are on disk together (one commit, one fsync) when UpdateTx
// returns nil, or none are. It does not wait to batch with other callers
// (bbolt's Batch does): the allocator gathers each step's changes itself
// and commits them with one call. (It was called Batch.)
func (d *DB) UpdateTx(fn func(tx *bolt.Tx) error) error { return d.bolt.Update(fn) }

// View runs fn in a read-only transaction on bucket; a missing bucket is
// passed as nil.
func (d *DB) View(bucket string, fn func(*bolt.Bucket) error) error {
	return d.bolt.View(func(tx *bolt.Tx) error { return fn(tx.Bucket([]byte(bucket))) })
}

// Get reads one value (a copy), or nil.
func (d *DB) Get(bucket, key string) ([]byte, error) {
	var out []byte
	err := d.View(bucket, func(b *bolt.Bucket) error {
		if b != nil {
			if v := b.Get([]byte(key)); v != nil {
				out = append([]byte(nil), v...)
			}
		}
		return nil
	})
	return out, err
}

// Put writes one value durably.
func (d *DB) Put(bucket, key string, value []byte) error {
	return d.Update(bucket, func(b *bolt.Bucket) error { return b.Put([]byte(key), value) })
}

const (
	metaBucket = "meta"
	nameKey    = "peer-name"
)

// PeerName returns the peer name persisted in the state, making and saving a
// random one on first start (never derived from the machine id: cloned VMs
// would share it). An explicit name overrides and is saved.
func (d *DB) PeerName(explicit string) (string, error) {
	if explicit != "" {
		return explicit, d.Put(metaBucket, nameKey, []byte(explicit))
	}
	v, err := d.Get(metaBucket, nameKey)
	if err != nil {
		return "", err
	}
	if len(v) > 0 {
		return string(v), nil
	}
	name := RandomPeerName()
	return name, d.Put(metaBucket, nameKey, []byte(name))
}

// RandomPeerName is a MAC-like name, as Weave's peers have, with the
// locally-administered bit set.
func RandomPeerName() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	b[0] = b[0]&^1 | 2
	return fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", b[0], b[1], b[2], b[3], b[4], b[5])
}
