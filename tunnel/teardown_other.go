//go:build !linux

package tunnel

// RemoveKernelIPIP does nothing where there is no kernel IPIP.
func RemoveKernelIPIP(name string) error { return nil }
