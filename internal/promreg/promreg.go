// Package promreg registers a package's Prometheus collectors all or none.
package promreg

import "github.com/prometheus/client_golang/prometheus"

// Register registers every collector with reg, or, if one fails, none: the
// ones already registered are unregistered again and the error returned.
// A nil reg registers nothing.
func Register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, d := range cs[:i] {
				reg.Unregister(d)
			}
			return err
		}
	}
	return nil
}
