// A small workload through go-redis v9's cluster client, checked as it runs:
// the workload every client library in tests/clients runs (see README.md
// there). It writes and reads its own keys, counts with INCR and keeps a
// hash, while the test around it fails a node over and switches the table's
// mode. A write that failed may or may not have taken effect, so each key
// keeps the values it may hold; any read outside them is a violation.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

const keys = 40

// possible is what a key may hold: the values of its writes since the last
// one known to have taken effect ("" for none).
type possible map[string]bool

func main() {
	nodes := flag.String("nodes", "127.0.0.1:7001", "cluster nodes, comma separated")
	seconds := flag.Float64("seconds", 8, "how long to run")
	prefix := flag.String("prefix", "go-redis", "prefix of this run's keys")
	flag.Parse()

	ctx := context.Background()
	client := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:        strings.Split(*nodes, ","),
		MaxRedirects: 16,
		ReadTimeout:  2 * time.Second,
		WriteTimeout: 2 * time.Second,
	})
	defer client.Close()

	values := make([]possible, keys)
	for i := range values {
		values[i] = possible{"": true}
	}
	var counterLow, counterHigh int64
	counter := *prefix + ":counter"
	hash := *prefix + ":hash"
	fields := map[string]possible{}
	ops, failures := 0, 0
	fail := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "go-redis: "+format+"\n", args...)
		os.Exit(1)
	}

	deadline := time.Now().Add(time.Duration(*seconds * float64(time.Second)))
	for sequence := 0; time.Now().Before(deadline); sequence++ {
		i := rand.Intn(keys)
		key := fmt.Sprintf("%s:k:%d", *prefix, i)
		value := strconv.Itoa(sequence)
		var err error
		switch choice := rand.Intn(10); {
		case choice < 4:
			if err = client.Set(ctx, key, value, 0).Err(); err == nil {
				values[i] = possible{value: true}
			} else {
				values[i][value] = true
			}
		case choice < 8:
			var got string
			got, err = client.Get(ctx, key).Result()
			if errors.Is(err, redis.Nil) {
				got, err = "", nil
			}
			if err == nil {
				if !values[i][got] {
					fail("GET %s = %q, not one of %v", key, got, values[i])
				}
				values[i] = possible{got: true}
			}
		case choice < 9:
			var got int64
			if got, err = client.Incr(ctx, counter).Result(); err == nil {
				if got < counterLow+1 || got > counterHigh+1 {
					fail("INCR %s = %d, not within [%d, %d]", counter, got, counterLow+1, counterHigh+1)
				}
				counterLow, counterHigh = got, got
			} else {
				counterHigh++
			}
		default:
			field := strconv.Itoa(i % 8)
			if fields[field] == nil {
				fields[field] = possible{"": true}
			}
			if err = client.HSet(ctx, hash, field, value).Err(); err == nil {
				fields[field] = possible{value: true}
			} else {
				fields[field][value] = true
			}
		}
		ops++
		if err != nil {
			// go-redis reloads its slot map on MOVED or once a minute; a
			// node that stopped answering sends no MOVED, so an application
			// asks for the reload when a command fails.
			failures++
			client.ReloadState(ctx)
			time.Sleep(20 * time.Millisecond)
		}
	}

	// Every key, the counter and the hash read back once the cluster has
	// settled, retrying errors for a while.
	settle := time.Now().Add(20 * time.Second)
	retry := func(read func() error) {
		for {
			err := read()
			if err == nil {
				return
			}
			if time.Now().After(settle) {
				fail("reading back: %v", err)
			}
			client.ReloadState(ctx)
			time.Sleep(100 * time.Millisecond)
		}
	}
	for i := range values {
		key := fmt.Sprintf("%s:k:%d", *prefix, i)
		retry(func() error {
			got, err := client.Get(ctx, key).Result()
			if errors.Is(err, redis.Nil) {
				got, err = "", nil
			}
			if err == nil && !values[i][got] {
				fail("at the end GET %s = %q, not one of %v", key, got, values[i])
			}
			return err
		})
	}
	retry(func() error {
		got, err := client.Get(ctx, counter).Int64()
		if errors.Is(err, redis.Nil) {
			got, err = 0, nil
		}
		if err == nil && (got < counterLow || got > counterHigh) {
			fail("at the end %s = %d, not within [%d, %d]", counter, got, counterLow, counterHigh)
		}
		return err
	})
	retry(func() error {
		got, err := client.HGetAll(ctx, hash).Result()
		if err == nil {
			for field, may := range fields {
				if !may[got[field]] {
					fail("at the end HGET %s %s = %q, not one of %v", hash, field, got[field], may)
				}
			}
		}
		return err
	})
	summary, _ := json.Marshal(map[string]any{"client": "go-redis", "ops": ops, "errors": failures})
	fmt.Println(string(summary))
}
