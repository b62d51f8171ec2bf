package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestRegisterAllOrNone(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := prometheus.NewCounter(prometheus.CounterOpts{Name: "a_total", Help: "a"})
	b := prometheus.NewCounter(prometheus.CounterOpts{Name: "b_total", Help: "b"})
	taken := prometheus.NewCounter(prometheus.CounterOpts{Name: "taken_total", Help: "c"})
	if err := reg.Register(taken); err != nil {
		t.Fatal(err)
	}
	clash := prometheus.NewCounter(prometheus.CounterOpts{Name: "taken_total", Help: "c"})
	if err := Register(reg, a, b, clash); err == nil {
		t.Fatal("registering a duplicate succeeded")
	}
	// a and b were rolled back: they register again cleanly.
	if err := Register(reg, a, b); err != nil {
		t.Fatalf("after the rollback: %v", err)
	}
	if err := Register(nil, a); err != nil {
		t.Fatalf("nil registerer: %v", err)
	}
}
