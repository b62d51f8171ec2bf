package state

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/weft-net/weft/internal/benchlat"
)

// The disk's own latency, the floor under every saved allocation: the
// baselines that the allocator's latency (ipalloc BenchmarkServiceAllocate20,
// router BenchmarkLocalAPIAllocate20) is read against in the same run.
// Each reports p50, p99 and max of one operation, one at a time, on the
// file system of the test's temporary directory (run it where --state-dir
// lives; TMPDIR=/dev/shm shows the CPU alone).
//
//	go test ./state -run '^$' -bench 'Fdatasync|Commit' -benchtime 4000x

// BenchmarkFdatasync is one 4 KiB write and its fdatasync: the disk's
// durable-write latency.
func BenchmarkFdatasync(b *testing.B) {
	f, err := os.Create(filepath.Join(b.TempDir(), "sync"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	page := make([]byte, 4096)
	benchlat.Concurrent(b, 1, "syncs", func(i int) error {
		if _, err := f.WriteAt(page, int64(i%16)*4096); err != nil {
			return err
		}
		return syscall.Fdatasync(int(f.Fd()))
	})
}

// BenchmarkCommit is one bbolt transaction that puts one allocation-sized
// record into a state file that already holds 1,000: what a step of the
// allocator with one ADD commits (bbolt writes the changed pages, syncs,
// writes its meta page and syncs again: two fdatasyncs per commit).
func BenchmarkCommit(b *testing.B) {
	db, err := Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	rec := []byte(`{"address":"10.32.0.17","meta":{"namespace":"default","name":"pod-with-a-name"}}`)
	if err := db.UpdateTx(func(tx *bolt.Tx) error {
		bk, err := tx.CreateBucketIfNotExists([]byte("allocations"))
		if err != nil {
			return err
		}
		for i := range 1000 {
			if err := bk.Put(fmt.Appendf(nil, "seed-%d\x00eth0", i), rec); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	benchlat.Concurrent(b, 1, "commits", func(i int) error {
		return db.UpdateTx(func(tx *bolt.Tx) error {
			return tx.Bucket([]byte("allocations")).Put(fmt.Appendf(nil, "c-%d\x00eth0", i), rec)
		})
	})
}
