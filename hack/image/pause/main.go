// Command pause is the sandbox process of a pod, like Kubernetes' pause: it
// holds the pod's namespaces, reaps the zombies that end up with it (it is
// pid 1 of the pod when the pid namespace is shared) and exits at SIGTERM or
// SIGINT. `go run ./hack/image -pause` puts it, static, into an image of its
// own, so that a test cluster needs no registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
